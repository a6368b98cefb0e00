"""Masked reductions shared by the algorithms (all over the positions where mask == 1)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum over mask positions; a non-finite value off the mask does not reach the sum."""
    x = torch.where(mask > 0, x, torch.zeros_like(x)) * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over mask positions; 0 where the mask is empty (instead of NaN)."""
    mask = mask.to(x.dtype)
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the mask positions (unbiased variance, as verl's masked_whiten)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def group_rows(uids: Sequence | np.ndarray) -> dict[object, list[int]]:
    """uid -> the row indices of its group, in row order (groups in first-seen order)."""
    groups: dict[object, list[int]] = defaultdict(list)
    for row, uid in enumerate(uids):
        groups[uid].append(row)
    return dict(groups)

