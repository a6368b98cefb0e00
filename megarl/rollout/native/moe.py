"""The built-in engine's mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE), and where its HF tensors go.

    moe = MoE(args, tp_size, dtype, device)        # one layer's router, experts, shared expert
    y = moe(h)                                     # h [..., hidden] -> this TP rank's partial sum

Routing as transformers computes it: softmax over all experts in fp32, top-k, renormalised when
`norm_topk_prob`; each token's output is the routing-weighted sum of its experts' SwiGLU. The
optional shared expert (Qwen2-MoE) is added scaled by sigmoid(shared_expert_gate(h)).

Tensor parallelism: every expert (and the shared expert) is split over the engine's TP ranks
along its intermediate dimension, exactly as the dense MLP is, so the layer's output is a partial
sum that the caller all-reduces once. The router is replicated. At training TP = rollout TP the
trainer's expert shards (expert TP = TP) are this rank's parts, so a weight sync sends them
without an all-gather. Experts run one after another over the tokens routed to them (simple; a
grouped GEMM would be faster on GPUs).

R3 recording: `moe(h, ids_out)` also writes the top-k expert ids into ids_out (rollout routing
replay: the trainer replays them; megarl/rollout/native/routes.py collects them per token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megarl.rollout.base import ShardSlice


def _param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, a, tp: int, dtype, device):
        super().__init__()
        if a.moe_intermediate_size % tp or a.shared_intermediate_size % tp:
            raise ValueError(f"rollout TP={tp} must divide moe_intermediate_size={a.moe_intermediate_size} and "
                             f"shared_expert_intermediate_size={a.shared_intermediate_size}")
        h, f, fs = a.hidden_size, a.moe_intermediate_size // tp, a.shared_intermediate_size // tp
        e = dict(dtype=dtype, device=device)
        self.gate = _param(a.num_experts, h, **e)                                      # router, replicated
        self.w13 = nn.ParameterList(_param(2 * f, h, **e) for _ in range(a.num_experts))  # [gate_r; up_r]
        self.w2 = nn.ParameterList(_param(h, f, **e) for _ in range(a.num_experts))
        self.shared13 = _param(2 * fs, h, **e) if fs else None
        self.shared2 = _param(h, fs, **e) if fs else None
        self.shared_gate = _param(1, h, **e) if fs else None
        self.topk, self.norm_topk = a.num_experts_per_tok, a.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, h] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        probs = F.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, ids = probs.topk(self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, h: torch.Tensor, ids_out: torch.Tensor | None = None) -> torch.Tensor:
        """ids_out (R3 recording): a [..., k] buffer shaped like h's tokens that receives the
        expert ids this router chose (an in-place copy, so a captured CUDA graph records it too)."""
        x = h.reshape(-1, h.shape[-1])                                                  # [N, h]
        weights, ids = self.route(x)
        if ids_out is not None:
            ids_out.copy_(ids.view(ids_out.shape))
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():                                                 # experts with tokens
            tok, slot = (ids == e).nonzero(as_tuple=True)
            g, u = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, self.w2[e]) * weights[tok, slot, None])
        if self.shared13 is not None:
            assert self.shared2 is not None and self.shared_gate is not None
            g, u = F.linear(x, self.shared13).chunk(2, dim=-1)
            out = out + F.linear(F.silu(g) * u, self.shared2) * torch.sigmoid(F.linear(x, self.shared_gate))
        return out.view_as(h)


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds expert ids 0..num_experts-1 (routed_experts' dtype)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


# -- weight routing (used by megarl/rollout/native/tp.py) -----------------------------------------------
def hf_names(a, layer: int) -> list[str]:
    """The HF tensors of layer `layer`'s MoE MLP."""
    p = f"model.layers.{layer}.mlp."
    names = [p + "gate.weight"]
    for e in range(a.num_experts):
        names += [f"{p}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
    if a.shared_intermediate_size:
        names += ([p + "shared_expert_gate.weight"]
                  + [f"{p}shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")])
    return names


def _leaf(leaf: str) -> tuple[str, int | None, str]:
    """'mlp.experts.3.up_proj.weight' -> ('experts', 3, 'up'); shared expert -> ('shared', None, 'up')."""
    parts = leaf.split(".")
    if parts[1] == "experts":
        return "experts", int(parts[2]), parts[3][:-5]
    return "shared", None, parts[2][:-5]


def full_shape(a, leaf: str) -> tuple[int, ...]:
    h = a.hidden_size
    if leaf == "mlp.gate.weight":
        return (a.num_experts, h)
    if leaf == "mlp.shared_expert_gate.weight":
        return (1, h)
    kind, _, w = _leaf(leaf)
    f = a.moe_intermediate_size if kind == "experts" else a.shared_intermediate_size
    return (h, f) if w == "down" else (f, h)


def target(a, tp: int, rank: int, layer: int, leaf: str) -> tuple[str, slice, ShardSlice]:
    """(local parameter, destination rows, the part of the HF tensor this rank holds)."""
    p = f"layers.{layer}.moe."
    if leaf == "mlp.gate.weight":
        return p + "gate", slice(None), ShardSlice()
    if leaf == "mlp.shared_expert_gate.weight":
        return p + "shared_gate", slice(None), ShardSlice()
    kind, e, w = _leaf(leaf)
    f = (a.moe_intermediate_size if kind == "experts" else a.shared_intermediate_size) // tp
    mine = ShardSlice(0, rank * f, (rank + 1) * f)
    up, down = (f"w13.{e}", f"w2.{e}") if kind == "experts" else ("shared13", "shared2")
    if w == "down":
        return p + down, slice(None), ShardSlice(1, rank * f, (rank + 1) * f)
    return p + up, (slice(0, f) if w == "gate" else slice(f, 2 * f)), mine
