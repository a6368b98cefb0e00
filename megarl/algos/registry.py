"""Name -> function registries for the algorithm choices a config makes.

`algorithm.adv_estimator`, `actor.policy_loss.loss_mode` and the KL types are looked up here, so
the training loop never branches on them. Users add their own with the decorators
(megarl.algos.advantages.register_adv_estimator, megarl.algos.losses.register_policy_loss,
megarl.algos.kl.register_kl) in a module imported before the config loads or named by
actor_rollout_ref.model.external_lib (docs/extending.md).

megarl's own entries are declared below as "module:function" paths, so the config knows every
built-in name without importing torch (the registry's shape, shared with every kind of extension, is
megarl/config/registry.py). A policy loss that reads keys of its own declares them as an options
class (the built-ins' in megarl/algos/loss_options.py); the user writes them beside loss_mode.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.plugins import import_external_libs
from megarl.config.registry import Registry
from megarl.config.typed import to_dict


def _paths(module: str, table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {name: f"megarl.algos.{module}:{fn}" for fn, names in table.items() for name in names}


ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator", _paths("advantages", {
    "gae": ("gae",), "grpo": ("grpo", "grpo_vectorized"), "drgrpo": ("drgrpo", "dr_grpo"), "rloo": ("rloo",),
    "rloo_vectorized": ("rloo_vectorized",), "opo": ("opo",), "gpg": ("gpg",),
    "grpo_passk": ("grpo_passk",), "reinforce_plus_plus": ("reinforce_plus_plus",),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline",), "remax": ("remax",)}))

POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode", {
    **_paths("losses", {"ppo_dual_clip_loss": ("vanilla", "dual_clip"), "ppo_clip_loss": ("ppo_clip",),
                        "gspo_loss": ("gspo",)}),
    **_paths("decoupled", {"decoupled_ppo_loss": ("decoupled_ppo",), "m2po_loss": ("m2po",)}),
    **_paths("pg_variants", {f"{name}_loss": (name,) for name in ("cispo", "sapo", "geo_mean", "clip_cov", "kl_cov",
                                                                  "gpg", "dro", "dppo_tv", "dppo_kl")})},
    options={name: f"megarl.algos.loss_options:{cls}" for name, cls in (
        ("clip_cov", "ClipCovOptions"), ("kl_cov", "KlCovOptions"), ("dro", "DroOptions"),
        ("decoupled_ppo", "DecoupledOptions"), ("m2po", "M2poOptions"))})
LOSS_KEY = "actor_rollout_ref.actor.policy_loss"

# A "+" suffix on any of them takes the k2 gradient (megarl/algos/kl.py)
KL_ESTIMATORS = Registry("KL estimator", "algorithm.kl_penalty", _paths("kl", {
    "kl_k1": ("kl", "k1"), "kl_abs": ("abs",), "kl_k2": ("mse", "k2"), "kl_k3": ("low_var_kl", "k3")}))


def check_algorithm_names(cfg) -> None:
    """Every algorithm the config names is registered: megarl's built-ins are known without importing
    them; a name of the user's is accepted once its module ran its decorator, before the config loads
    or as actor_rollout_ref.model.external_lib / critic.model.external_lib (imported here for that)."""
    actor = cfg.actor
    names: list[tuple[Registry, str, str]] = [
        (ADV_ESTIMATORS, cfg.algorithm.adv_estimator, "algorithm.adv_estimator"),
        (POLICY_LOSSES, actor.policy_loss.loss_mode, "actor_rollout_ref.actor.policy_loss.loss_mode"),
        (KL_ESTIMATORS, cfg.algorithm.kl_penalty.removesuffix("+"), "algorithm.kl_penalty"),
        (KL_ESTIMATORS, actor.kl_loss_type.removesuffix("+"), "actor_rollout_ref.actor.kl_loss_type")]
    if not all(name in registry for registry, name, _ in names):
        import_external_libs(cfg)
        for registry, name, key in names:
            registry.check(name, key)
    given = actor.policy_loss.options
    given = to_dict(given) if dataclasses.is_dataclass(given) else given
    actor.policy_loss.options = POLICY_LOSSES.build_options(actor.policy_loss.loss_mode, given, LOSS_KEY,
                                                            tolerated=_another_loss_at_default, beside=["loss_mode"])


def _another_loss_at_default(key: str, value: Any) -> bool:
    """A key another loss reads, at that loss's default, is accepted and left unread: verl writes
    every loss's keys into each config (its clip_cov_ratio, kl_cov_ratio ...). Another value is one line."""
    readers = [(name, cls) for name in POLICY_LOSSES.names() if (cls := POLICY_LOSSES.options_of(name))
               and key in {f.name for f in dataclasses.fields(cls)}]
    if not readers:
        return False
    default = next(f.default for f in dataclasses.fields(readers[0][1]) if f.name == key)
    if _same(value, default):
        return True
    raise ConfigError(f"is read by loss_mode={' or '.join(n for n, _ in readers)} only; set that loss or remove "
                      "the key", f"{LOSS_KEY}.{key}")


def _same(value: Any, default: Any) -> bool:
    if value is None or default is None or isinstance(value, bool):
        return value is default
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return value == default
