"""RL algorithms as small pure tensor functions, chosen by name from the config.

    advantages.py          gae, grpo, drgrpo, rloo, reinforce_plus_plus(_baseline), remax, grpo_passk
    losses.py              policy losses (vanilla/dual_clip, ppo_clip, gspo), aggregation, value loss
    kl.py                  KL estimators k1/k2/k3/abs, KL-in-reward with fixed/adaptive controllers
    loss_fn.py             make_actor_loss_fn / make_critic_loss_fn for the Megatron workers
    dapo.py                dynamic sampling and overlong reward shaping
    rollout_correction.py  rollout/trainer mismatch metrics and truncated importance sampling
    metrics.py             data, timing and throughput metrics with verl's names

Names below are imported on first use, so that loading a config (megarl.algos.config) stays
free of torch.
"""
import importlib

_EXPORTS = {
    "compute_advantage": "advantages", "get_adv_estimator": "advantages",
    "apply_kl_penalty": "kl", "kl_penalty": "kl", "make_kl_controller": "kl",
    "make_actor_loss_fn": "loss_fn", "make_critic_loss_fn": "loss_fn", "mean_metrics": "loss_fn",
    "agg_loss": "losses", "get_policy_loss": "losses",
    "compute_data_metrics": "metrics", "compute_timing_metrics": "metrics", "compute_throughput_metrics": "metrics",
    "rollout_mismatch_metrics": "rollout_correction", "DynamicSampler": "dapo", "overlong_penalty": "dapo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megarl.algos.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megarl.algos' has no attribute {name!r}")
