"""Causal attention over packed sequences (THD: [t, heads, hn], boundaries in cu_seqlens).

    out = varlen_causal(q, k, v, cu_seqlens, max_seqlen, scale, dropout)   # [t, heads, hn]

Each sequence attends only to itself, so no work goes to other sequences or to padding. On CUDA
with fp16/bf16, flash-attn's varlen kernel runs the whole pack at once when it is installed;
otherwise (CPU, fp32, or no flash-attn) SDPA runs once per sequence, which is exact and costs
sum(s_i^2) rather than T^2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: pip install flash-attn (CUDA only)
    from flash_attn import flash_attn_varlen_func
except Exception:  # noqa: BLE001 - absent or built for another torch: fall back to SDPA
    flash_attn_varlen_func = None


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
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, s_i, hn]
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, dropout_p=dropout)
            pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces, dim=0)
