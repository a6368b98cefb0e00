"""Decode attention of the built-in engine (megarl/rollout/native/model.py): each row's query
against its group's prompt K/V, read once for the group's samples, and against its own generated
tokens, the two softmaxes merged through their log-sum-exps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def attend_shared(q, pk, pv, ck, cv, m: "DecodeMeta") -> torch.Tensor:
    """q [B, hkv, g, hd] -> [B, hkv, g, hd] (fp32). The prompt part once per group: the n samples'
    queries (n*g rows per KV head) against the group's prompt K/V, read once (a matrix product
    instead of n vector products); then each row's own tokens; the two softmaxes merged."""
    B, hkv, g, hd = q.shape
    scale = hd ** -0.5
    # A (group, sample) with no active row takes row 0's query: computed, never read.
    qg = q.index_select(0, m.inv).view(m.G, m.n, hkv, g, hd).transpose(1, 2).reshape(m.G, hkv, m.n * g, hd)
    o_p, lse_p = attend(qg, pk[:m.G, :, :m.Lp], pv[:m.G, :, :m.Lp], m.pbias, scale)
    o_p = o_p.view(m.G, hkv, m.n, g, hd).transpose(1, 2)[m.grp_out, m.member]             # [B, hkv, g, hd]
    lse_p = lse_p.view(m.G, hkv, m.n, g, 1).transpose(1, 2)[m.grp_out, m.member]
    o_s, lse_s = attend(q, ck[:B, :, :m.Ls], cv[:B, :, :m.Ls], m.sbias, scale)
    # The row's part weighs exp(lse_s) / (exp(lse_p) + exp(lse_s)) = sigmoid(lse_s - lse_p).
    return torch.lerp(o_p, o_s, torch.sigmoid(lse_s - lse_p))


# Masked keys get this additive bias rather than -inf: a row with no visible key (a parked row,
# an unused group) then gets finite garbage instead of NaN, and a visible key is never affected.
MASKED = -1e30


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """Softmax attention that also returns the log-sum-exp, so two key sets can be merged.
    q [..., m, hd], k/v [..., L, hd], bias [..., 1 or m, L] (fp32, 0 or MASKED) ->
    out [..., m, hd] fp32, lse [..., m, 1]. On CPU: torch's fused flash kernel for CPU, the one
    SDPA itself dispatches to, called directly because SDPA does not return the log-sum-exp
    (one parallel kernel instead of ten small operations, which cost more than the arithmetic at
    decode sizes). Elsewhere: attend_matmul (under CUDA graphs operation count costs nothing)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None and q.dtype == torch.float32:
        out, lse = _CPU_FLASH(q, k, v, attn_mask=bias, scale=scale)
        return out, lse.unsqueeze(-1)
    return attend_matmul(q, k, v, bias, scale)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """attend() as two matrix products: scores and softmax in fp32, as transformers' eager path;
    the scale on q (the small side), one exp over the scores (in place), the normalisation after
    the product (fewer numbers)."""
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float().add_(bias)
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights.to(v.dtype), v).float().div_(total)
    return out, total.log_().add_(top)


@dataclass
class DecodeMeta:
    """What every layer of one decode step needs besides its weights (built once per step)."""
    rows: torch.Tensor        # [B] 0..B-1
    spos: torch.Tensor        # [B] where each row's new K/V goes in its generated part
    grp_out: torch.Tensor     # [B] the row's group, clamped into 0..G-1
    member: torch.Tensor      # [B] the row's sample index within its group
    inv: torch.Tensor         # [G*n] the row holding each (group, sample), 0 where none does
    pbias: torch.Tensor       # [G, 1, 1, Lp] prompt keys each group may see (fp32, 0 or MASKED)
    sbias: torch.Tensor       # [B, 1, 1, Ls] generated keys each row may see
    G: int
    n: int
    Lp: int
    Ls: int
