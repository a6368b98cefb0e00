"""The model converters' names, known without importing torch: `actor_rollout_ref.model.converters`
and `critic.model.converters` are checked against them when the config loads (megarl/models/
converters.py holds what a converter is and builds them; megarl's own are declared here by path)."""
from __future__ import annotations

from collections.abc import Mapping

from megarl.config.plugins import import_external_libs
from megarl.config.registry import Registry

CONVERTERS = Registry("model converter", "actor_rollout_ref.model.converters", {
    "lora": "megarl.models.lora:lora"})


def _named(converters) -> list[str]:
    return list(converters or ())        # a list of names, or a mapping name -> options


def check_converter_names(cfg) -> None:
    """Every converter a role names is registered (a user's once its module ran, before the config
    loads or as model.external_lib): one line with the known names otherwise. The options given to a
    converter that declares an options class are typed and checked against it."""
    roles = [("actor_rollout_ref.model.converters", cfg.model.converters),
             ("critic.model.converters", cfg.critic.model.converters)]
    named = [(key, name) for key, converters in roles for name in _named(converters)]
    if not all(name in CONVERTERS for _, name in named):
        import_external_libs(cfg)
        for key, name in named:
            CONVERTERS.check(name, key)
    for key, converters in roles:
        if isinstance(converters, Mapping):
            for name, given in converters.items():
                if CONVERTERS.options_of(name) is not None:
                    CONVERTERS.build_options(name, given, f"{key}.{name}")
