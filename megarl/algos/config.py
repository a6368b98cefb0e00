"""Configuration of the RL algorithm (`algorithm.*`), verl's keys and meanings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.typed import require

# Advantage estimators that compare the n responses of one prompt with each other.
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "grpo_passk", "dr_grpo")
CRITIC_ESTIMATORS = ("gae",)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose `metric` has zero variance and refill the batch."""
    enable: bool = False
    metric: str = "acc"                    # "acc", "score" or "seq_reward"
    max_num_gen_batches: int = 10          # rollouts per step before giving up (0 = no limit)


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment inside the last `len` tokens of the response budget."""
    enable: bool = False
    len: int = 16
    penalty_factor: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """Rollout/trainer mismatch: truncated importance sampling from the rollout's log-probs."""
    rollout_is: Literal["token", "sequence"] | None = None  # None: only log the mismatch
    rollout_is_threshold: float = 2.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"             # gae, grpo, drgrpo, rloo, reinforce_plus_plus, remax, ...
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"                 # kl (k1), abs, mse (k2), low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self):
        require(0 <= self.gamma <= 1, "gamma", "must be within [0, 1]")
        require(0 <= self.lam <= 1, "lam", "must be within [0, 1]")

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS

    @property
    def is_group_relative(self) -> bool:
        return self.adv_estimator in GROUP_ESTIMATORS
