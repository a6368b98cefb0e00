"""Configuration of rewards (`reward_model.*` and `custom_reward_function.*`), verl's keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.typed import require


@dataclass
class CustomRewardFunctionConfig:
    """A user's `fn(data_source, solution_str, ground_truth, extra_info=None, **kw) -> float | dict`."""
    path: str | None = None                # a .py file or an importable module
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardModelConfig:
    enable: bool = False                   # score with a model (critic backbone + score head)
    model: dict[str, Any] = field(default_factory=dict)  # {path, tokenizer_path}
    micro_batch_size_per_gpu: int = 4
    # naive: one call per sample; batch: one call for the whole batch; or
    # "pkg.module:Class" / "file.py:Class", a manager called with the batch (seed 001).
    reward_manager: str = "naive"
    reward_manager_kwargs: dict[str, Any] = field(default_factory=dict)
    launch_reward_fn_async: bool = False   # score in a Ray pool while ref/critic passes run
    num_workers: int = 2                   # Ray pool size for async scoring
    timeout_s: float = 10.0                # per-sample limit for a reward function
    # A sample whose reward function raises or times out gets this score and is counted.
    failure_score: float = 0.0
    max_failure_fraction: float = 1.0      # above this fraction of a batch failing, stop the run
    format_score: float = 0.0
    format_reward: Literal["none", "think", "answer_tag"] = "none"

    def __post_init__(self):
        require(self.timeout_s > 0, "timeout_s", "must be > 0 seconds")
        require(self.num_workers >= 1, "num_workers", "must be >= 1")
        require(0 <= self.max_failure_fraction <= 1, "max_failure_fraction", "must be within [0, 1]")
