"""Where a sequence-level score lands in a batch: on each row's last counted response token.

    scores = place_scores(batch, [1.0, 0.0, ...])    # [B] -> [B, R]
"""
from __future__ import annotations

import torch


def last_token_index(batch) -> torch.Tensor:
    """Per row, the position of the last response token that counts (mask 1); 0 when none."""
    mask = batch.batch["response_mask"]
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(-1).values.clamp(min=0)   # [B]


def response_lengths(batch) -> torch.Tensor:
    b = batch.batch
    if "response_lens" in b:
        return b["response_lens"]
    return last_token_index(batch) + (b["response_mask"].sum(-1) > 0).long()


def place_scores(batch, scores) -> torch.Tensor:
    """[B] scores -> [B, R] with each score on the row's last counted response token."""
    mask = batch.batch["response_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[torch.arange(mask.shape[0]), last_token_index(batch).cpu()] = torch.as_tensor(scores, dtype=torch.float32)
    return out
