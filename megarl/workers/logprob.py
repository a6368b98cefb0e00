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
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group. (megatron's
    copy_to_tensor_model_parallel_region all-reduces `grad.contiguous()` and returns `grad`, so a
    non-contiguous gradient, e.g. through [s, b, h] -> [b, s, h], would go unsummed.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
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


# -- lean path: the LM head fused with the log-prob, chunked over tokens --------------------------------
# The logits of a micro-batch ([tokens, V/TP], ~600 MB per 1k tokens at a 152k vocabulary in
# fp32) never exist whole: each chunk of tokens is projected, reduced to (log p, entropy) and
# dropped; backward projects each chunk again. Kept for backward: the hidden states (which the
# model keeps anyway), the head weight (a parameter) and three fp32 numbers per token.
CHUNK_BYTES = 64 << 20  # fp32 logits of one chunk


def chunk_tokens(vocab_local: int) -> int:
    return max(16, CHUNK_BYTES // (4 * max(vocab_local, 1)))


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 z / temperature; at temperature 1 (fp32 weights) no [tokens, V] copy is made, where
    dividing made one per chunk in forward and two in backward for the same bits."""
    z = z.float()
    return z if temperature == 1 else z / temperature


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, valid, group, temperature, with_entropy, entropy_grad,
                chunk, weight_grad_scale):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        mean_z = torch.empty_like(lse)
        target_z = torch.empty_like(lse)
        w = weight[:valid]
        tp = group is not None and dist.get_world_size(group) > 1
        for a in range(0, n, chunk):
            z = _scaled(hidden[a:a + chunk] @ w.t(), temperature)             # [c, valid] fp32
            peak = z.max(dim=-1).values if valid else torch.full((z.shape[0],), float("-inf"), device=z.device)
            if tp:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            shifted = z - peak.unsqueeze(-1)
            exp = shifted.exp()
            local = targets[a:a + chunk] - vocab_start
            here = (local >= 0) & (local < valid)
            picked = shifted.gather(-1, local.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1) if valid \
                else torch.zeros_like(peak)
            sums = torch.stack([exp.sum(-1), torch.where(here, picked, torch.zeros_like(picked)),
                                (exp * shifted).sum(-1) if with_entropy else torch.zeros_like(peak)])
            if tp:
                dist.all_reduce(sums, group=group)
            log_sum = sums[0].log()
            lse[a:a + chunk] = peak + log_sum
            target_z[a:a + chunk] = sums[1] - log_sum                          # log p(target)
            mean_z[a:a + chunk] = peak + sums[2] / sums[0]                     # E_p[z]
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.args = (vocab_start, valid, temperature, entropy_grad, chunk, weight_grad_scale)
        entropy = lse - mean_z if with_entropy else None
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return target_z, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        vocab_start, valid, temperature, entropy_grad, chunk, weight_grad_scale = ctx.args
        w = weight[:valid]
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 accumulation across chunks, like one matmul's; cast to the weight's dtype once.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        use_ent = entropy_grad and g_ent is not None
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a:a + chunk]
            z = _scaled(h @ w.t(), temperature)
            p = (z - lse[a:a + chunk].unsqueeze(-1)).exp()
            # d log p(t) / dz = onehot(t) - p;  dH / dz = -p (z - E_p[z])
            gz = -p * g_lp[a:a + chunk].unsqueeze(-1)
            if use_ent:
                gz -= p * (z - mean_z[a:a + chunk].unsqueeze(-1)) * g_ent[a:a + chunk].float().unsqueeze(-1)
            local = targets[a:a + chunk] - vocab_start
            here = (local >= 0) & (local < valid)
            rows = here.nonzero().squeeze(-1)
            gz[rows, local[rows]] += g_lp[a:a + chunk][rows]
            gz = _scaled(gz, temperature).to(hidden.dtype)
            if grad_h is not None:
                grad_h[a:a + chunk] = gz @ w
            if grad_w is not None:
                grad_w[:valid] += (gz.t() @ h).float()
        if grad_w is not None:
            grad_w = (grad_w * weight_grad_scale if weight_grad_scale != 1 else grad_w).to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                     vocab_size: int, group=None, temperature: float = 1.0, with_entropy: bool = True,
                     entropy_grad: bool = True, chunk: int | None = None,
                     weight_grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [n, h] (this rank's full hidden states at the positions to score), weight [V_local, h]
    (this TP rank's vocabulary rows of the LM head), targets [n] global ids -> (log p(target) [n],
    entropy [n] or None) of softmax(hidden @ weight.T / temperature), fp32. The same numbers as
    token_log_probs on the materialised logits. The entropy carries gradients only when
    `entropy_grad` (an entropy bonus); otherwise it is a detached metric. Under TP the caller
    passes hidden through megatron's copy-to-TP-region (all-reduce of its gradient), as the
    output layer does. `weight_grad_scale` scales the head weight's gradient (1/CP under context
    parallelism: every CP rank scores the whole gathered sequence, and megatron sums weight
    gradients over the CP ranks)."""
    valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    chunk = chunk or chunk_tokens(valid)
    return _LinearLogProbs.apply(hidden, weight, targets, vocab_start, valid, group, temperature, with_entropy,
                                 entropy_grad, chunk, weight_grad_scale)


def hidden_to_head(output_layer, sequence_parallel: bool) -> None:
    """Make megatron's output layer hand back its input (the final hidden states, prepared as the
    layer would: gathered over sequence parallelism, or marked for the TP all-reduce of its
    gradient) so the log-prob code applies the head itself, chunk by chunk. Parameters keep their
    names, so checkpoints, conversion maps and the optimizer see no change."""

    def forward(input_, weight=None, runtime_gather_output=None):
        if sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True), None
        group = parallel_state.get_tensor_model_parallel_group()
        return (_CopyToGroup.apply(input_, group) if dist.get_world_size(group) > 1 else input_), None

    output_layer.forward = forward
