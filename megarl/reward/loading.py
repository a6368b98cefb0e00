"""Load a user's reward function or reward-manager class by path, checking it before any work.

    custom_reward_function:            # verl's keys
      path: my_reward.py               # a .py file, or an importable module (pkg.rewards)
      name: compute_score              # def compute_score(data_source, solution_str, ground_truth,
      reward_kwargs: {scale: 2.0}      #                   extra_info=None, **reward_kwargs) -> float | dict

The function is called with keyword arguments, so its parameter names matter. With
`reward_model.reward_manager=batch` it is called once per batch instead:
    compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs) -> list
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.plugins import check_signature, get_attr, import_path
from megarl.reward.config import CustomRewardFunctionConfig
from megarl.reward.rules import default_compute_score

SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


@dataclass(frozen=True)
class RewardFnSpec:
    """What a scoring process needs to load the function itself (Ray workers re-import it)."""
    path: str | None = None                     # None: megarl's default rules
    name: str = "compute_score"
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False

    @property
    def is_default(self) -> bool:
        return self.path is None

    def load(self):
        if self.path is None:
            return default_compute_score
        fn = get_attr(import_path(self.path, "custom_reward_function.path"), self.name,
                      "custom_reward_function.name", "function")
        if not callable(fn):
            raise ConfigError(f"{self.name!r} in {self.path} is not callable", "custom_reward_function.name")
        check_signature(fn, BATCH_ARGS if self.batched else SAMPLE_ARGS, self.kwargs, "custom_reward_function.name")
        return fn


def load_reward_fn(cfg: CustomRewardFunctionConfig, batched: bool = False):
    """(spec, function) from `custom_reward_function` (CustomRewardFunctionConfig), checked."""
    spec = RewardFnSpec(cfg.path, cfg.name, dict(cfg.reward_kwargs), batched)
    if spec.is_default and batched:
        raise ConfigError("reward_manager=batch needs custom_reward_function.path (a function taking lists); "
                          "the built-in rules score one sample at a time: use reward_manager=naive",
                          "reward_model.reward_manager")
    return spec, spec.load()


