"""Reward shaping: what is added to each sample's task score, as [B] tensors.

    shaping = Shaping(format_kind="think", format_score=0.25, overlong_len=16, max_response_length=512)
    bonus = format_bonus(format_ok, shaping.format_score)                     # [B]
    penalty = overlong_penalty(lengths, 512, shaping.overlong_len, 1.0)       # [B], DAPO (algos/dapo.py)

The reward manager (megarl/reward/manager.py) places both on each response's last token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.errors import ConfigError


@dataclass(frozen=True)
class Shaping:
    """reward_model.format_reward / format_score and algorithm.overlong_buffer, read once."""
    format_kind: str = "none"              # none, think, answer_tag (megarl/reward/rules.py:format_reward)
    format_score: float = 0.0
    overlong_len: int | None = None        # None: no overlong penalty
    overlong_penalty_factor: float = 1.0
    max_response_length: int | None = None

    def __post_init__(self):
        if self.overlong_len is not None and not self.max_response_length:
            raise ConfigError("overlong_buffer needs the response budget (data.max_response_length)",
                              "algorithm.overlong_buffer.enable")

    @classmethod
    def of(cls, format_kind: str, format_score: float, overlong, max_response_length: int | None) -> "Shaping":
        """From reward_model's format keys and algorithm.overlong_buffer (OverlongBufferConfig)."""
        on = overlong is not None and overlong.enable
        return cls(format_kind, format_score, overlong.len if on else None,
                   overlong.penalty_factor if on else 1.0, max_response_length)


def format_bonus(format_ok: torch.Tensor, format_score: float) -> torch.Tensor:
    """[B]: format_score where the response follows the format (1.0), else 0."""
    return format_score * format_ok.to(torch.float32)
