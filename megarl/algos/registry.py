"""Name -> function registries for the algorithm choices a config makes.

`algorithm.adv_estimator`, `actor.policy_loss.loss_mode` and the KL types are looked up here, so
the training loop never branches on them. Users add their own with the decorators
(megarl.algos.advantages.register_adv_estimator, megarl.algos.losses.register_policy_loss,
megarl.algos.kl.register_kl) in a module imported before the config loads or named by
actor_rollout_ref.model.external_lib (docs/extending.md).

megarl's own entries are declared below as "module:function" paths, so the config knows every
built-in name without importing torch (the registry's shape, shared with every kind of extension, is
megarl/config/registry.py).
"""
from __future__ import annotations

from megarl.config.plugins import import_external_libs
from megarl.config.registry import Registry


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
                                                                  "gpg", "dro", "dppo_tv", "dppo_kl")})})

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
    if all(name in registry for registry, name, _ in names):
        return
    import_external_libs(cfg)
    for registry, name, key in names:
        registry.check(name, key)
