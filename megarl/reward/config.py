"""Configuration of rewards (`reward_model.*` and `custom_reward_function.*`), verl's keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.typed import Section, require


@dataclass
class CustomRewardFunctionConfig(Section):
    """A user's `fn(data_source, solution_str, ground_truth, extra_info=None, **kw) -> float | dict`."""
    path: str | None = None                # a .py file or an importable module
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardModelConfig(Section):
    enable: bool = False                   # score with a model (critic backbone + score head)
    model: dict[str, Any] = field(default_factory=dict)  # {path, tokenizer_path}
    micro_batch_size_per_gpu: int | None = 4  # null (verl 0.7's default): needed only when enable is true
    # naive: one call per sample; batch: one call for the whole batch; or
    # "pkg.module:Class" / "file.py:Class", a manager called with the batch (as verl calls its managers).
    reward_manager: str = "naive"
    reward_manager_kwargs: dict[str, Any] = field(default_factory=dict)
    # Score in a pool of Ray actors (ray.init locally when no Ray is running) while the
    # reference/critic passes run; a worker stuck past timeout_s is killed and replaced.
    launch_reward_fn_async: bool = False
    num_workers: int = 2                   # Ray pool size for async scoring
    timeout_s: float = 10.0                # per-sample limit (in process: SIGALRM, Python code only)
    # The whole reward step of one batch. Past it the run stops with one line naming the reward
    # function and the slowest samples (before the other ranks' collective timeout would fire
    # with no word of the reward). None: 0.8 x trainer.collective_timeout_s.
    batch_deadline_s: float | None = None
    # A sample whose reward function raises or times out gets this score and is counted
    # (reward/failures, reward/timeouts); the run goes on unless more than max_failure_fraction
    # of one batch failed, which usually means a broken function: then it stops with the first error.
    failure_score: float = 0.0
    max_failure_fraction: float = 0.9
    # A bonus of format_score when the response follows format_reward (think: one <think>...</think>
    # block then an answer; answer_tag: one non-empty <answer>...</answer>).
    format_score: float = 0.0
    format_reward: Literal["none", "think", "answer_tag"] = "none"

    def __post_init__(self):
        require(self.reward_manager != "dapo", "reward_manager",
                "verl's dapo manager is megarl's naive one with DAPO's overlong penalty, which megarl applies "
                "under algorithm.overlong_buffer (enable, len, penalty_factor; verl's reward_model.overlong_buffer "
                "and reward_kwargs.overlong_buffer_cfg are read as it); set reward_model.reward_manager=naive")
        # Only a manager class takes arguments: under naive or batch they would be read by nothing.
        require(not self.reward_manager_kwargs or self.reward_manager not in ("naive", "batch"),
                "reward_manager_kwargs",
                f"{sorted(self.reward_manager_kwargs)} would do nothing: the {self.reward_manager} manager takes no "
                "arguments (verl's reward_kwargs other than overlong_buffer_cfg and max_resp_len land here); pass "
                "the scoring function's arguments in custom_reward_function.reward_kwargs, or name a manager class "
                "(reward_model.reward_manager=pkg.module:Class) whose __init__ takes them")
        require(self.timeout_s > 0, "timeout_s", "must be > 0 seconds")
        require(self.batch_deadline_s is None or self.batch_deadline_s > 0, "batch_deadline_s", "must be > 0 seconds")
        require(self.num_workers >= 1, "num_workers", "must be >= 1")
        require(not self.enable or self.micro_batch_size_per_gpu is not None, "micro_batch_size_per_gpu",
                "null (verl 0.7's default) gives the reward model no micro batch; set a number of sequences (e.g. 4)")
        require(0 <= self.max_failure_fraction <= 1, "max_failure_fraction", "must be within [0, 1]")

