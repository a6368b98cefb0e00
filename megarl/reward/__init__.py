"""Rewards: rule functions, custom functions by path, reward managers, and a Ray scoring pool.

    math_answer.py  GSM8K `#### n` and `\\boxed{}` answer checking
    rules.py        default_compute_score (dispatch by data source), integer and format rewards
    loading.py      a user's function or manager class by path, signatures checked up front
    manager.py      RewardManager: batch in, token_level_scores [B, R] + per-sample info out
    pool.py         the Ray actor pool: parallel scoring with a per-sample timeout

Names below are imported on first use (loading a config stays free of torch and ray).
"""
import importlib

_EXPORTS = {
    "default_compute_score": "rules", "format_reward": "rules", "integer_score": "rules",
    "gsm8k_score": "math_answer", "boxed_score": "math_answer",
    "load_reward_fn": "loading", "RewardManager": "manager", "RewardResult": "manager",
    "RewardFailure": "manager", "build_reward_manager": "manager",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megarl.reward.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megarl.reward' has no attribute {name!r}")
