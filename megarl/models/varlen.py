"""Causal attention over packed sequences (THD: [t, heads, hn], boundaries in cu_seqlens).

    out = varlen_causal(q, k, v, cu_seqlens, max_seqlen, scale, dropout)   # [t, heads, hn]

Each sequence attends only to itself, so no work goes to other sequences or to padding. On CUDA
with fp16/bf16, flash-attn's varlen kernel runs the whole pack at once when it is installed.
Otherwise (CPU, fp32, or no flash-attn) the sequences are laid out as right-padded rows of
similar length and each group runs as one causal SDPA call: with padding only after a row's
real tokens, causal attention never lets a real query see a pad key, so real outputs are the
per-sequence ones (the pad rows' outputs are dropped). One call per group instead of one per
sequence: a micro-batch of many short sequences (RL's prompts + responses) paid a fixed cost
per sequence, forward and backward (benchmarks/update_profile.py). Groups keep the padded
work within PAD_COST of sum(s_i^2), or rows no longer than SHORT, where padding costs less than
another call. Long sequences keep a call each (their own cost dwarfs a call's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: pip install flash-attn (CUDA only)
    from flash_attn import flash_attn_varlen_func
except Exception:  # noqa: BLE001 - absent or built for another torch: fall back to SDPA
    flash_attn_varlen_func = None

PAD_COST = 1.5   # a group's rows x longest^2 may reach this many times its sum(s_i^2)
SHORT = 32       # rows up to this long always share one group


def length_groups(lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar length (longest first), each padded to its longest."""
    order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: (-lens[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            top = lens[g[0]]
            if top <= SHORT or (len(g) + 1) * top * top <= PAD_COST * sum(lens[j] ** 2 for j in g + [i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  scale: float, dropout: float = 0.0) -> torch.Tensor:
    """q [t, heads, hn], k/v [t, kv_heads, hn] (GQA: heads a multiple of kv_heads) -> [t, heads, hn]."""
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout,
                                      softmax_scale=scale, causal=True)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    bounds = cu_seqlens.tolist()
    starts, lens = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    pieces, where = [], []          # per group: its real tokens' outputs, and their pack positions
    for grp in length_groups(lens):
        first = torch.tensor([starts[i] for i in grp]).unsqueeze(1)
        n = torch.tensor([lens[i] for i in grp]).unsqueeze(1)
        col = torch.arange(lens[grp[0]]).unsqueeze(0)
        real = col < n                                                     # [rows, width]
        # pack positions; pad columns repeat the row's last token (no real query attends them)
        index = first + torch.minimum(col, n - 1)
        qi, ki, vi = (t[index.to(q.device)].transpose(1, 2) for t in (q, k, v))   # [rows, heads, width, hn]
        out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, dropout_p=dropout)
        pieces.append(out.transpose(1, 2)[real.to(q.device)])              # [tokens, heads, hn], row-major
        where.append(index[real])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    pos = torch.cat(where) if len(where) > 1 else where[0]
    if torch.equal(pos, torch.arange(q.shape[0])):
        return out
    back = torch.empty_like(pos)
    back[pos] = torch.arange(len(pos))
    return out[back.to(q.device)]
