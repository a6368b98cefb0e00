"""Context parallelism for megarl's local spec: the sequence split over a CP group of size C.

megatron's load-balanced split (the one its RoPE assumes, `get_pos_emb_on_this_cp_rank`): the
sequence is cut into 2C equal chunks and CP rank r holds chunks r and 2C-1-r, so every rank gets
the same amount of causal-attention work.

    local_ids = split_sequence(ids, cp_rank, cp, dim=1)           # [b, S] -> [b, S/C]
    full = gather_sequence(local_out, group, dim=1, sum_grads=False)  # [b, S/C, ..] -> [b, S, ..]
    core_attention=CPCoreAttention in the layer spec                # attention over the whole sequence

megatron's own CP attention is Transformer Engine's (ring / all-gather kernels), absent from the
local spec, so `CPCoreAttention` gathers K and V over the CP group (its backward sums each rank's
K/V gradients back to their owner) and runs SDPA per local chunk with the chunk's causal offset.
All-gather K/V is the simplest exact scheme: memory for K/V grows with the full sequence, while
the activations, MLPs and logits stay split. The sequence length must divide by 2C.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from megarl.models.attention import SDPACoreAttention


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2*cp sequence chunks that CP rank `cp_rank` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor (sequence along `dim`, length divisible by 2*cp)."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not a multiple of 2 x CP = {2 * cp}; pad it first")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def _reorder(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Each CP rank's local tensor (its two chunks) -> the full sequence in natural order."""
    cp = len(parts)
    chunks = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(r, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim: int, sum_grads: bool):
        ctx.group, ctx.dim, ctx.sum_grads = group, dim, sum_grads
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return _reorder(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sum_grads:  # each rank's grad covers only its queries' use of the gathered tensor
            dist.all_reduce(grad, group=ctx.group)
        cp = dist.get_world_size(ctx.group)
        return split_sequence(grad, dist.get_rank(ctx.group), cp, ctx.dim), None, None, None


def gather_sequence(x: torch.Tensor, group, dim: int, sum_grads: bool) -> torch.Tensor:
    """All CP ranks' parts -> the full sequence, differentiable.

    sum_grads=True when each rank uses the gathered tensor for a different part of the loss
    (K/V in attention: the owner's gradient is the sum over ranks); False when every rank
    computes the same loss from it (the model output before the loss): then each rank keeps
    its own slice of the gradient, and DDP's sum over the DP x CP group adds the ranks' parts."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim, sum_grads)


def causal_chunk_attention(q, k, v, q_start: int, scale: float, dropout: float) -> torch.Tensor:
    """q [b, h, c, d] at global positions q_start.. ; k, v [b, h, S, d] from position 0.
    Keys past the chunk's last position are dropped; the rest get the causal mask with offset."""
    c = q.shape[2]
    end = q_start + c
    k, v = k[:, :, :end], v[:, :, :end]
    mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(diagonal=q_start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout)


class CPCoreAttention(SDPACoreAttention):
    """SDPACoreAttention over a sequence split by context parallelism (load-balanced chunks)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type: str = "self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = ps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("CPCoreAttention takes neither packed sequences nor an attention bias")
        cp = dist.get_world_size(self.cp_group)
        if cp == 1:
            return super().forward(query, key, value)
        rank = dist.get_rank(self.cp_group)
        key = gather_sequence(key, self.cp_group, 0, sum_grads=True)      # [S, b, kv_heads, hn]
        value = gather_sequence(value, self.cp_group, 0, sum_grads=True)
        groups = query.shape[2] // key.shape[2]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, heads, s, hn]
        c = q.shape[2] // 2
        dropout = self.dropout if self.training else 0.0
        outs = [causal_chunk_attention(q_part, k, v, idx * c, self.softmax_scale, dropout)
                for q_part, idx in zip(q.split(c, dim=2), chunk_ids(rank, cp))]
        out = torch.cat(outs, dim=2)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s_local, b, heads*hn]
