"""Per-token log-probs and entropy from vocab-parallel logits, differentiable, exact for TP>1.

Each TP rank holds logits for vocabulary rows [vocab_start, vocab_start + V_local); rows past the
real vocabulary (padding) are dropped before the softmax so they carry no probability. The
partition function and the target logit are summed over TP ranks with an all-reduce whose
backward is the identity (the loss after it is the same on every TP rank).

    log_probs, entropy = token_log_probs(logits, targets, vocab_start, vocab_size, tp_group)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumOverGroup.apply(x, group)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                    group=None, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V_local] (this rank's vocabulary rows, already divided by the temperature),
    targets [...] global token ids -> (log p(target) [...], entropy [...] or None), in fp32."""
    valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))
    logits = logits[..., :valid].float()
    if valid:
        peak = logits.detach().max(dim=-1).values
    else:
        peak = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)  # <= 0; the shift cancels in every result below
    exp = shifted.exp()
    sum_exp = _sum(exp.sum(dim=-1), group)
    log_z = sum_exp.log()
    local = targets - vocab_start
    here = (local >= 0) & (local < valid)
    picked = shifted.gather(-1, local.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1) if valid else \
        torch.zeros_like(peak)
    target_logit = _sum(torch.where(here, picked, torch.zeros_like(picked)), group)
    log_probs = target_logit - log_z
    if not with_entropy:
        return log_probs, None
    # H = log Z - E_p[z] with z the shifted logits.
    mean_z = _sum((exp * shifted).sum(dim=-1), group) / sum_exp
    return log_probs, log_z - mean_z
