"""Tensor parallelism of the built-in engine: the collectives, and where each HF tensor's slice goes.

    comm = TPComm(group)                  # or TPComm(None) for one rank
    plan = ShardPlan(args, comm.rank, comm.size)
    for dst_param_name, dst_rows, src in plan.route("model.layers.0.self_attn.q_proj.weight", full):
        ...                               # copy `src` (a view of the full tensor) into the param rows
    plan.target(name)                     # (param, rows, ShardSlice): the part of `name` this rank holds

Column-parallel: q/k/v, gate/up, the vocabulary of embeddings and lm_head (split rows).
Row-parallel: o_proj and down_proj (split columns, all-reduce after). Norms are replicated.
gloo on CPU, nccl on CUDA: whatever backend the group was created with.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.rollout.base import ShardSlice
from megarl.rollout.native import moe
from megarl.rollout.native.model import LocalSizes, ModelArgs, hook_part

# torch >= 2.12 renames all_gather_into_tensor (the old name warns); older torch has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPComm:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if group is None or not dist.is_initialized():
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._nccl = self.size > 1 and dist.get_backend(group) == "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' tensors along the last dimension (rank order)."""
        x = x.contiguous()
        if self._nccl:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            _all_gather(out, x, group=self.group)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def agree(self, value: int) -> int:
        """The group's first rank's `value`, on every rank (e.g. a random seed)."""
        if self.size == 1:
            return value
        assert self.group is not None             # size > 1: a group was given
        t = torch.tensor([value], dtype=torch.long, device="cuda" if self._nccl else "cpu")
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ShardPlan:
    """HF name + full tensor -> (local parameter name, destination row slice, source view).

    A destination is a slice of rows of a local parameter because q/k/v share `wqkv` and
    gate/up share `w13`; the source is a view of the full tensor (no copy of the whole model).
    """

    def __init__(self, args: ModelArgs, rank: int, size: int):
        self.a, self.rank, self.size = args, rank, size
        self.s = LocalSizes.of(args, size)
        self._expected = set(self.expected_names())

    def expected_names(self) -> list[str]:
        """Every HF tensor a full sync must deliver (finalize refuses if one is missing)."""
        a = self.a
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not a.tie_embeddings:
            names.append("lm_head.weight")
        for i in range(a.n_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                      p + "self_attn.o_proj.weight"]
            names += moe.hf_names(a, i) if a.num_experts else \
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
            if a.qkv_bias:
                names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
            if a.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            names += [p + t.hf for t in a.hooks.layer_tensors(a, i).values()]
        return names

    def full_shape(self, name: str) -> tuple[int, ...]:
        a, hd = self.a, self.a.head_dim
        h, i = a.hidden_size, a.intermediate_size
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (a.vocab_size, h)
        if name == "model.norm.weight":
            return (h,)
        layer, leaf = _layer_leaf(name)
        if a.num_experts and leaf.startswith("mlp."):
            return moe.full_shape(a, leaf)
        hooked = {t.hf: t.shape for t in a.hooks.layer_tensors(a, int(layer)).values()}
        if leaf in hooked:
            return hooked[leaf]
        return {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (a.n_heads * hd, h), "self_attn.q_proj.bias": (a.n_heads * hd,),
            "self_attn.k_proj.weight": (a.n_kv_heads * hd, h), "self_attn.k_proj.bias": (a.n_kv_heads * hd,),
            "self_attn.v_proj.weight": (a.n_kv_heads * hd, h), "self_attn.v_proj.bias": (a.n_kv_heads * hd,),
            "self_attn.o_proj.weight": (h, a.n_heads * hd), "self_attn.o_proj.bias": (h,),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        }[leaf]

    def _kv_rows(self) -> slice:
        a, s, hd = self.a, self.s, self.a.head_dim
        first = self.rank * s.kv_heads if a.n_kv_heads >= self.size else self.rank // (self.size // a.n_kv_heads)
        return slice(first * hd, (first + s.kv_heads) * hd)

    def target(self, name: str) -> tuple[str, slice, ShardSlice] | None:
        """(local parameter, its destination rows, the part of the full HF tensor that goes
        there) for HF tensor `name`; None for tensors this model ignores. Raises on unknown names."""
        a, s, r, hd = self.a, self.s, self.rank, self.a.head_dim
        if name.endswith("rotary_emb.inv_freq"):
            return None                         # a buffer some checkpoints carry; recomputed here
        if name == "lm_head.weight" and a.tie_embeddings:
            return None                         # tied: the embedding is the output layer
        if name not in self._expected:
            raise ValueError(f"weight update: unknown tensor {name!r} for this {a.n_layers}-layer "
                             f"{a.family} model (expected HF names such "
                             "as model.layers.0.self_attn.q_proj.weight)")
        whole, every = ShardSlice(), slice(None)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo = min(r * s.vocab, a.vocab_size)
            hi = min(lo + s.vocab, a.vocab_size)
            return ("embed" if name.startswith("model.") else "lm_head"), slice(0, hi - lo), ShardSlice(0, lo, hi)
        if name == "model.norm.weight":
            return "norm", every, whole
        layer, leaf = _layer_leaf(name)
        if a.num_experts and leaf.startswith("mlp."):
            return moe.target(a, self.size, r, int(layer), leaf)
        p = f"layers.{layer}."
        q_rows, kv_rows = s.heads * hd, s.kv_heads * hd
        mine_q = (r * q_rows, (r + 1) * q_rows)
        mine_i = (r * s.intermediate, (r + 1) * s.intermediate)
        kv = self._kv_rows()
        kv_part = ShardSlice(0, kv.start, kv.stop)
        table = {
            "self_attn.o_proj.weight": (p + "wo", every, ShardSlice(1, *mine_q)),
            "self_attn.o_proj.bias": (p + "bo", every, whole),
            "mlp.gate_proj.weight": (p + "w13", slice(0, s.intermediate), ShardSlice(0, *mine_i)),
            "mlp.up_proj.weight": (p + "w13", slice(s.intermediate, 2 * s.intermediate), ShardSlice(0, *mine_i)),
            "mlp.down_proj.weight": (p + "w2", every, ShardSlice(1, *mine_i)),
            "input_layernorm.weight": (p + "attn_norm", every, whole),
            "post_attention_layernorm.weight": (p + "mlp_norm", every, whole),
        }
        for t in a.hooks.layer_tensors(a, int(layer)).values():   # a split one: this rank's rows along t.split
            n = hook_part(t.shape, t.split, self.size)[t.split] if t.split is not None else 0
            table[t.hf] = (p + "extra." + t.hf.replace(".", "_"), every,
                           whole if t.split is None else ShardSlice(t.split, r * n, (r + 1) * n))
        for proj, rows, part in (("q", slice(0, q_rows), ShardSlice(0, *mine_q)),
                                 ("k", slice(q_rows, q_rows + kv_rows), kv_part),
                                 ("v", slice(q_rows + kv_rows, q_rows + 2 * kv_rows), kv_part)):
            table[f"self_attn.{proj}_proj.weight"] = (p + "wqkv", rows, part)   # q/k/v share the fused
            table[f"self_attn.{proj}_proj.bias"] = (p + "bqkv", rows, part)     # weight (and bias)
        return table[leaf]

    def route(self, name: str, full: torch.Tensor) -> Iterator[tuple[str, slice, torch.Tensor]]:
        """Where this rank's part of `full` goes. Raises on names/shapes the model does not have."""
        got = self.target(name)
        if got is None:
            return
        shape = self.full_shape(name)
        if tuple(full.shape) != shape:
            raise ValueError(f"weight update: {name} has shape {tuple(full.shape)}, expected {shape} "
                             "(is the stream from the same model config?)")
        dst, rows, part = got
        yield dst, rows, part.take(full)

    def route_shard(self, name: str, piece: torch.Tensor) -> Iterator[tuple[str, slice, torch.Tensor]]:
        """Like route, for `piece` = this rank's part of the full tensor (ShardPlan.target's slice)."""
        got = self.target(name)
        if got is None:
            return
        dst, rows, part = got
        want = list(self.full_shape(name))
        if part.dim is not None:
            want[part.dim] = part.stop - part.start
        if list(piece.shape) != want:
            raise ValueError(f"weight update: shard of {name} has shape {tuple(piece.shape)}, expected "
                             f"{tuple(want)} on TP rank {self.rank} of {self.size}")
        yield dst, rows, piece


def _layer_leaf(name: str) -> tuple[str, str]:
    """'model.layers.3.self_attn.q_proj.weight' -> ('3', 'self_attn.q_proj.weight')."""
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"native rollout engine: {name!r} is not a weight it knows")
    return match.group(1), match.group(2)
