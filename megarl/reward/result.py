"""A reward step's result, and the tensors a user's manager or a reward model hands back read as scores.

    result = RewardResult(token_level_scores)      # [B, R], each score on its response's last token
    result.apply(batch)                            # token_level_scores + info fields in the batch
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megarl.protocol import DataProto
from megarl.reward.placement import place_scores

EXTRA_COLUMN = "reward_extra_info"   # the batch's per-row column of verl's reward_extra_info


@dataclass
class RewardResult:
    token_level_scores: torch.Tensor               # [B, R], each score on its response's last token
    extra_info: dict[str, list] = field(default_factory=dict)   # per-sample fields (acc, pred, ...)
    metrics: dict[str, float] = field(default_factory=dict)
    notice: str = ""                               # samples that failed to score, for the console
    # verl's reward_extra_info, per sample: a dict result's every key (score included), a number as
    # {"acc": score}, plus megarl's shaping fields; what the dumps and val-aux/* metrics show.
    reward_extra_info: dict[str, list] = field(default_factory=dict)

    def apply(self, batch: DataProto) -> None:
        batch.batch["token_level_scores"] = self.token_level_scores
        for key, values in self.extra_info.items():
            batch.non_tensor_batch[key] = np.array(values, dtype=object)
        # One per-row dict column, so rows selected or concatenated (DAPO's rounds) keep theirs.
        n = self.token_level_scores.shape[0]
        column = np.empty(n, dtype=object)
        column[:] = [{k: v[i] for k, v in self.reward_extra_info.items()} for i in range(n)]
        batch.non_tensor_batch[EXTRA_COLUMN] = column


def as_token_level(batch: DataProto, value: Any, what: str) -> torch.Tensor:
    """A tensor [B] (placed on each row's last response token), [B, R], or a list of floats -> [B, R]."""
    if isinstance(value, (list, tuple, np.ndarray)):
        value = torch.as_tensor(np.asarray(value, dtype=np.float32))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a tensor [B] or [B, R] or a list of floats, got {type(value).__name__}")
    mask = batch.batch["response_mask"]
    value = value.detach().float().cpu()
    if value.dim() == 1 and value.shape[0] == mask.shape[0]:
        return place_scores(batch, value)
    if value.dim() == 2 and value.shape[0] == mask.shape[0]:
        if value.shape[1] != mask.shape[1]:
            raise ValueError(f"{what} has {value.shape[1]} columns but responses have {mask.shape[1]}")
        return value * mask.float().cpu()
    raise ValueError(f"{what} has shape {tuple(value.shape)}; expected [{mask.shape[0]}] or {tuple(mask.shape)}")


def result_of_class(batch: DataProto, out: Any, name: str) -> RewardResult:
    """What a user's manager class returned: scores, or {"reward_tensor", "reward_extra_info"} as in verl."""
    info: dict[str, list] = {}
    if isinstance(out, dict):
        if "reward_tensor" not in out:
            raise TypeError(f"{name} returned a dict without 'reward_tensor' (keys: {sorted(out)})")
        info = {k: list(v) for k, v in (out.get("reward_extra_info") or {}).items()}
        out = out["reward_tensor"]
    return RewardResult(as_token_level(batch, out, f"{name}(batch)"), info, reward_extra_info=dict(info))
