"""Sequence lengths that sequence and context parallelism can split.

    S = padded_length(seq=37, tp=2, cp=2)     # 40: a multiple of TP (SP) and of 2 x CP
    ids = pad_columns(ids, S)                 # right-pad [b, seq] token rows with id 0

Sequence parallelism cuts the sequence over the TP ranks, context parallelism into 2 x CP
load-balanced chunks (megarl/models/context_parallel.py); with both, each CP part is cut again
over TP, so the length must divide by TP x 2 x CP. The pad sits after every real token, so causal
attention keeps it out of every real position; the engine cuts the output back to `seq`.
"""
from __future__ import annotations

import torch


def seq_multiple(tp: int, cp: int) -> int:
    """What the sequence length must be a multiple of: TP under SP (pass tp=1 without SP), 2 x CP under CP."""
    return tp * (2 * cp if cp > 1 else 1)


def padded_length(seq: int, tp: int = 1, cp: int = 1) -> int:
    unit = seq_multiple(tp, cp)
    return -(-seq // unit) * unit


def pad_columns(ids: torch.Tensor, length: int, value: int = 0) -> torch.Tensor:
    """[b, s] -> [b, length] with `value` appended (a no-op when s == length)."""
    extra = length - ids.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad {ids.shape[1]} columns down to {length}")
    return ids if extra == 0 else torch.nn.functional.pad(ids, (0, extra), value=value)
