"""`<role>.model.override_config` checked against what the model's HF config knows, before any
rank starts (megarl/launcher/preflight.py). An override is applied as an attribute of the HF config
(megarl/models/hf_config.py: with_overrides); a key the config class does not define would be a
stray entry that nothing reads, so it is refused in one line naming the attribute meant, or
the megatron section where a TransformerConfig field goes.

    check_override_keys(read_hf_config(path), cfg.model.override_config, "actor_rollout_ref.model.override_config",
                        "actor_rollout_ref.actor.megatron")
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import AutoConfig

from megarl.config.errors import ConfigError
from megarl.config.typed import closest
from megarl.models.hf_config import hf_overrides


def known_attributes(hf: Mapping[str, Any]) -> set[str]:
    """config.json's keys, and the attributes (and aliases) of its transformers config class."""
    known = set(hf)
    try:
        default = AutoConfig.for_model(str(hf.get("model_type")))
    except ValueError:          # a model type transformers does not know (remote code): its config.json alone
        return known
    return known | set(default.to_dict()) | set(default.attribute_map)


def check_override_keys(hf: Mapping[str, Any], override_config: Mapping[str, Any], key: str,
                        megatron_key: str) -> None:
    """`key`: where the overrides are (actor_rollout_ref.model.override_config); `megatron_key`: the
    role's megatron section, where a TransformerConfig field belongs."""
    overrides = hf_overrides(override_config)
    if not overrides:
        return
    where = f"{key}.model_config" if "model_config" in override_config else key
    known = known_attributes(hf)
    for name in overrides:
        if name in known:
            continue
        # megatron is not imported here (--check stays free of its import-time warnings): a
        # TransformerConfig field is named in the line's fix rather than recognised
        hint = closest(name, sorted(known))
        raise ConfigError(f"the model's HF config ({hf.get('model_type')}) has no attribute {name!r}; "
                          + (f"did you mean {hint!r}? " if hint else "")
                          + "override only attributes its config class defines (a megatron TransformerConfig "
                          f"field goes in {megatron_key}.override_transformer_config.{name})", f"{where}.{name}")
