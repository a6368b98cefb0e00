"""What the reward manager reads, one typed object built from the experiment's tree.

    settings = RewardSettings.of(cfg)       # reward_model.*, algorithm.overlong_buffer, data.max_response_length
    manager = RewardManager(tokenizer, build_scorer(cfg, tokenizer), settings)

Beside the sections (megarl/reward/config.py) rather than in them: the shaping it holds is an
algorithm's (megarl/algos/shaping.py), and section configs import no tensor code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.algos.shaping import Shaping


@dataclass(frozen=True)
class RewardSettings:
    """What the reward manager reads, built once from the experiment's tree (`RewardSettings.of(cfg)`);
    how a batch is scored is the scorer's (megarl/reward/scorers.py)."""
    failure_score: float = 0.0             # reward_model.failure_score
    max_failure_fraction: float = 0.9      # reward_model.max_failure_fraction
    deadline_s: float | None = None        # reward_model.batch_deadline_s
    shaping: Shaping = Shaping()           # format bonus and DAPO's overlong penalty

    @classmethod
    def of(cls, cfg: Any) -> "RewardSettings":
        """From an ExperimentConfig: reward_model.*, algorithm.overlong_buffer, data.max_response_length."""
        rm = cfg.reward_model
        shaping = Shaping.of(rm.format_reward, rm.format_score, cfg.algorithm.overlong_buffer,
                             cfg.data.max_response_length)
        return cls(rm.failure_score, rm.max_failure_fraction, rm.batch_deadline_s, shaping)
