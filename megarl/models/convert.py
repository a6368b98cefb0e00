"""Pure HF <-> megatron-core parameter conversion for megarl's local spec, for every registered
family (megarl/models/families/): the attention, norms, embedding and head here; the MLP's part
from the family's MLP flavour (`spec.model_family.mlp`: dense, or experts and router), the
tensors a family adds by code from its hooks' `layer_tensors` (megarl/models/families/hooks.py).

No I/O and no process groups: every function takes the TP rank/size it is about. Names on the
megatron side are *global* (layer index counted over the whole model, no DDP `module.` prefix):

    embedding.word_embeddings.weight                [Vp/T, h]   vocab rows, padded to Vp
    decoder.layers.N.input_layernorm.weight         [h]
    decoder.layers.N.self_attention.linear_qkv.weight  [ng/T*(np/ng+2)*hn, h]  per group [q.., k, v]
    decoder.layers.N.self_attention.linear_qkv.bias    (Qwen2)
    decoder.layers.N.self_attention.linear_proj.weight [h, np*hn/T]
    decoder.layers.N.pre_mlp_layernorm.weight       [h]
    decoder.layers.N.mlp.linear_fc1.weight          [2*f/T, h]  [gate_r; up_r]
    decoder.layers.N.mlp.linear_fc2.weight          [h, f/T]
    decoder.layers.N.<a family hook's tensor>       whole, or split along its declared dim (HookTensor)
    decoder.layers.N.mlp.router.weight              [E, h]      (MoE, replicated)
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight  [2*fe/T, h]  E: *global* expert
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight  [h, fe/T]
    decoder.layers.N.mlp.shared_experts.linear_fc{1,2}.weight, .gate_weight [1, h]   (Qwen2-MoE)
    decoder.final_layernorm.weight                  [h]
    output_layer.weight                             [Vp/T, h] lm head, or [1, h] value head

The three entry points (the checkpoint engine builds its transfer plan on them):

    hf_slices(name, spec, tp_rank, tp, head)   -> [Slice]     what rank tp_rank reads from HF
    assemble(name, pieces, spec, tp_rank, tp, head) -> Tensor  its shard, from those slices
    megatron_to_hf(name, tp_shards, spec, head) -> [(hf_name, Tensor)]   full HF tensors back

`head` is "lm" (causal LM: output_layer is lm_head, or the embedding when tied) or "value"
(critic: output_layer is a [1, h] value head, HF `score.weight`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megarl.models.families.hooks import HookTensor
from megarl.models.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
_PER_LAYER = {  # megatron suffix -> HF suffix under model.layers.N. (fused ones handled below)
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_REPLICATED = {"input_layernorm.weight", "pre_mlp_layernorm.weight"}


def _ffn(rest: str, spec: ModelSpec) -> tuple[str, int, str] | None:
    """For a SwiGLU linear of the family's MLP (dense MLP, one expert, the shared expert): ("fc1" |
    "fc2", its intermediate size, the HF prefix under model.layers.N.); None for anything else."""
    return spec.model_family.mlp.ffn(rest, spec)


def _whole(spec: ModelSpec, layer: int) -> dict[str, HookTensor]:
    """Layer `layer`'s tensors its family decides: its MLP flavour's (router...) and its hooks'."""
    return {**spec.model_family.mlp.replicated(spec), **check_hook_tensors(spec, layer)}


def check_hook_tensors(spec: ModelSpec, layer: int) -> dict[str, HookTensor]:
    """The family hooks' tensors of layer `layer`; ValueError when a declared split names no dim, or
    disagrees with the name rules (megatron's module of that name splits by them: a wrong shard)."""
    out = spec.model_family.hooks.layer_tensors(spec, layer)
    for rest, t in out.items():
        (known, dim), where = _rule_dim(rest), f"family {spec.family!r}: hook tensor decoder.layers.{layer}.{rest}"
        if t.split is not None and not 0 <= t.split < len(t.shape):
            raise ValueError(f"{where} {t.shape} declares split={t.split}, which names no dim of it; declare "
                             f"one in 0..{len(t.shape) - 1}, or None for whole")
        if known and dim != t.split:
            raise ValueError(f"{where} declares split={t.split}, but its name reads as split={dim} (convert.tp_dim); "
                             f"declare split={dim}, or give it a name the shared rules do not read")
    return out


def _split_size(spec: ModelSpec, layer: int, rest: str, t: HookTensor, tp: int) -> int:
    assert t.split is not None              # rows (along t.split) of one TP rank's part
    if t.shape[t.split] % tp:
        raise ValueError(f"family {spec.family!r}: hook tensor decoder.layers.{layer}.{rest} {t.shape} splits dim "
                         f"{t.split} over TP {tp}, which does not divide it; use a TP size that divides it")
    return t.shape[t.split] // tp


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of one HF tensor; dim None = the whole tensor."""
    hf_name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, max(0, self.stop - self.start))


# -- names ------------------------------------------------------------------------------------------
def megatron_names(spec: ModelSpec, layers: range, first: bool, last: bool, head: str = "lm",
                   experts: range | None = None) -> list[str]:
    """Global megatron names of the parameters a pipeline stage holds (`layers` = its global
    layers; `experts` = the global experts this expert-parallel rank holds, default all)."""
    names = [EMBED] if first else []
    for n in layers:
        p = f"decoder.layers.{n}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if spec.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [p + rest for rest in check_hook_tensors(spec, n)]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        names += spec.model_family.mlp.megatron_names(spec, p, experts)
    if last:
        names.append(FINAL_NORM)
        # A tied LM on a single stage has no output_layer weight (it reads the embedding's).
        if head == "value" or not (spec.tie_word_embeddings and first):
            names.append(OUTPUT)
    return names


def to_global(local_name: str, offset: int, expert_offset: int = 0) -> str:
    """`decoder.layers.3.x` on a stage whose first layer is global `offset` -> `decoder.layers.{3+offset}.x`;
    a local expert index i on an expert-parallel rank whose first expert is `expert_offset` -> i + expert_offset."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    rest, e = m.group(2), _EXPERT.match(m.group(2))
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + offset}.{rest}"


def to_local(global_name: str, offset: int, expert_offset: int = 0) -> str:
    return to_global(global_name, -offset, -expert_offset)


def expert_of(name: str) -> int | None:
    """The global expert index of an expert weight's megatron name, else None."""
    m = _LAYER.match(name)
    e = _EXPERT.match(m.group(2)) if m else None
    return int(e.group(1)) if e else None


def hf_names(name: str, spec: ModelSpec, head: str = "lm") -> list[str]:
    """The HF tensors megatron tensor `name` is made of."""
    if name == EMBED:
        return ["model.embed_tokens.weight"]
    if name == FINAL_NORM:
        return ["model.norm.weight"]
    if name == OUTPUT:
        if head == "value":
            return ["score.weight"]
        return ["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"{name!r} is not a megatron parameter of the Llama/Qwen2 local spec")
    n, rest = m.group(1), m.group(2)
    p = f"model.layers.{n}."
    if rest in _PER_LAYER:
        return [p + _PER_LAYER[rest]]
    whole = _whole(spec, int(n))
    if rest in whole:
        return [p + whole[rest].hf]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
    ffn = _ffn(rest, spec)
    if ffn is not None:
        kind, _, q = ffn
        return [p + q + "gate_proj.weight", p + q + "up_proj.weight"] if kind == "fc1" else [p + q + "down_proj.weight"]
    raise KeyError(f"{name!r} is not a megatron parameter of megarl's local spec")


def hf_shapes(spec: ModelSpec, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Every HF tensor a checkpoint must hold for `spec`, with its shape. head="lm" adds lm_head
    (unless tied), "value" a one-row `score.weight`, "none" nothing past the final norm."""
    h, hn = spec.hidden_size, spec.head_dim
    out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (spec.num_heads * hn, h),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * hn, h),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * hn, h),
            p + "self_attn.o_proj.weight": (h, spec.num_heads * hn),
        })
        out.update({p + t.hf: t.shape for t in check_hook_tensors(spec, n).values()})
        out.update(spec.model_family.mlp.hf_shapes(spec, p))
        if spec.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (spec.num_heads * hn,),
                        p + "self_attn.k_proj.bias": (spec.num_kv_heads * hn,),
                        p + "self_attn.v_proj.bias": (spec.num_kv_heads * hn,)})
    if head == "value":
        out["score.weight"] = (1, h)
    elif head == "lm" and not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


# -- shapes -----------------------------------------------------------------------------------------
def shard_shape(name: str, spec: ModelSpec, tp: int, head: str = "lm") -> tuple[int, ...]:
    """Shape of one TP rank's shard of megatron tensor `name`."""
    h, hn = spec.hidden_size, spec.head_dim
    if name == EMBED or (name == OUTPUT and head == "lm"):
        return (spec.padded_vocab(tp) // tp, h)
    if name == OUTPUT:
        return (1, h)
    if name == FINAL_NORM:
        return (h,)
    n, rest = _LAYER.match(name).groups()
    ffn = _ffn(rest, spec)
    if ffn is not None:
        kind, ff, _ = ffn
        return (2 * ff // tp, h) if kind == "fc1" else (h, ff // tp)
    t = _whole(spec, int(n)).get(rest)
    if t is not None:
        return tuple(_split_size(spec, int(n), rest, t, tp) if d == t.split else x for d, x in enumerate(t.shape))
    return {
        "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (spec.qkv_rows // tp, h),
        "self_attention.linear_qkv.bias": (spec.qkv_rows // tp,),
        "self_attention.linear_proj.weight": (h, spec.num_heads * hn // tp),
    }[rest]


# -- HF -> megatron -----------------------------------------------------------------------------------
def hf_slices(name: str, spec: ModelSpec, tp_rank: int, tp: int, head: str = "lm") -> list[Slice]:
    """The HF rows/columns TP rank `tp_rank` needs to build its shard of `name` (nothing more)."""
    srcs = hf_names(name, spec, head)
    if name in (EMBED, OUTPUT) and not (name == OUTPUT and head == "value"):
        rows = spec.padded_vocab(tp) // tp
        start = tp_rank * rows  # rows past the real vocabulary are padding and read nothing
        return [Slice(srcs[0], 0, min(start, spec.vocab_size), min(start + rows, spec.vocab_size))]
    if name in (FINAL_NORM, OUTPUT):
        return [Slice(srcs[0])]
    n, rest = _LAYER.match(name).groups()
    t = _whole(spec, int(n)).get(rest)
    if rest in _REPLICATED or (t is not None and t.split is None):
        return [Slice(srcs[0])]
    if t is not None and t.split is not None:
        rows = _split_size(spec, int(n), rest, t, tp)
        return [Slice(srcs[0], t.split, tp_rank * rows, (tp_rank + 1) * rows)]
    ffn = _ffn(rest, spec)
    if rest == "self_attention.linear_proj.weight" or (ffn and ffn[0] == "fc2"):
        cols = spec.num_heads * spec.head_dim // tp if ffn is None else ffn[1] // tp
        return [Slice(srcs[0], 1, tp_rank * cols, (tp_rank + 1) * cols)]
    if rest.startswith("self_attention.linear_qkv"):
        groups = spec.num_kv_heads // tp
        q_rows, kv_rows = groups * spec.q_per_group * spec.head_dim, groups * spec.head_dim
        q, k, v = srcs
        return [Slice(q, 0, tp_rank * q_rows, (tp_rank + 1) * q_rows),
                Slice(k, 0, tp_rank * kv_rows, (tp_rank + 1) * kv_rows),
                Slice(v, 0, tp_rank * kv_rows, (tp_rank + 1) * kv_rows)]
    if ffn and ffn[0] == "fc1":
        rows = ffn[1] // tp
        return [Slice(s, 0, tp_rank * rows, (tp_rank + 1) * rows) for s in srcs]
    raise KeyError(name)


def assemble(name: str, pieces: Mapping[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int,
             head: str = "lm") -> torch.Tensor:
    """TP rank `tp_rank`'s shard of `name` from the pieces `hf_slices` named (keyed by HF name,
    each already sliced)."""
    srcs = hf_names(name, spec, head)
    if name in (EMBED, OUTPUT) and not (name == OUTPUT and head == "value"):
        rows = spec.padded_vocab(tp) // tp
        got = pieces[srcs[0]]
        if got.shape[0] == rows:
            return got
        out = got.new_zeros((rows, *got.shape[1:]))  # padded vocabulary rows are zero
        out[: got.shape[0]] = got
        return out
    rest = _LAYER.match(name).group(2) if name.startswith("decoder.layers.") else ""
    if rest.startswith("self_attention.linear_qkv"):
        q, k, v = (pieces[s] for s in srcs)
        groups, hn = spec.num_kv_heads // tp, spec.head_dim
        tail = q.shape[1:]  # (h,) for weights, () for biases
        fused = torch.cat([q.reshape(groups, spec.q_per_group, hn, *tail), k.reshape(groups, 1, hn, *tail),
                           v.reshape(groups, 1, hn, *tail)], dim=1)
        return fused.reshape(-1, *tail)
    if len(srcs) == 2:                     # a SwiGLU fc1: [gate_r; up_r]
        return torch.cat([pieces[srcs[0]], pieces[srcs[1]]], dim=0)
    return pieces[srcs[0]]


def hf_to_megatron(name: str, hf: Mapping[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int,
                   head: str = "lm") -> torch.Tensor:
    """TP rank `tp_rank`'s shard of `name` from full HF tensors (convenience over the two above)."""
    pieces = {s.hf_name: s.take(hf[s.hf_name]) for s in hf_slices(name, spec, tp_rank, tp, head)}
    return assemble(name, pieces, spec, tp_rank, tp, head)


# -- megatron -> HF -----------------------------------------------------------------------------------
def tp_dim(name: str, head: str = "lm", spec: ModelSpec | None = None) -> int | None:
    """Dimension along which global megatron name `name` is split over TP ranks (None:
    replicated): the shared name rules, else the split a family hook declares (given `spec`)."""
    if name == EMBED or (name == OUTPUT and head == "lm"):
        return 0
    m = _LAYER.match(name)
    if not m:
        return None
    known, dim = _rule_dim(m.group(2))
    hooked = None if known or spec is None else check_hook_tensors(spec, int(m.group(1))).get(m.group(2))
    return hooked.split if hooked is not None else dim


def _rule_dim(rest: str) -> tuple[bool, int | None]:
    """(whether the shared rules read per-layer suffix `rest`, the dim they split it along)."""
    if rest in _REPLICATED:
        return True, None
    rows = rest.startswith("self_attention.linear_qkv") or rest.endswith("linear_fc1.weight")
    cols = rest == "self_attention.linear_proj.weight" or rest.endswith("linear_fc2.weight")
    return (True, 1) if cols else (True, 0) if rows else (False, None)


def megatron_to_hf(name: str, tp_shards: Sequence[torch.Tensor], spec: ModelSpec,
                   head: str = "lm") -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards (in TP-rank order) of megatron tensor `name`.
    A tied LM's last-stage output_layer copy yields nothing: the embedding carries it."""
    srcs = hf_names(name, spec, head)
    if name == OUTPUT and head == "lm" and spec.tie_word_embeddings:
        return []
    dim = tp_dim(name, head, spec)
    if dim is None:
        return [(srcs[0], tp_shards[0])]
    if name in (EMBED, OUTPUT):
        return [(srcs[0], torch.cat(list(tp_shards), 0)[: spec.vocab_size])]
    rest = _LAYER.match(name).group(2)
    if rest.startswith("self_attention.linear_qkv"):
        # TP shards hold whole KV groups in order, so their concatenation is the full fused tensor.
        fused = torch.cat(list(tp_shards), 0)
        tail = fused.shape[1:]
        grouped = fused.reshape(spec.num_kv_heads, spec.q_per_group + 2, spec.head_dim, *tail)
        q = grouped[:, : spec.q_per_group].reshape(-1, *tail)
        k = grouped[:, spec.q_per_group].reshape(-1, *tail)
        v = grouped[:, spec.q_per_group + 1].reshape(-1, *tail)
        return list(zip(srcs, (q, k, v)))
    if rest.endswith("linear_fc1.weight"):
        # Each shard is [gate_r; up_r]: concatenating shards would interleave them.
        halves = [s.chunk(2, dim=0) for s in tp_shards]
        gate = torch.cat([g for g, _ in halves], 0)
        up = torch.cat([u for _, u in halves], 0)
        return [(srcs[0], gate), (srcs[1], up)]
    return [(srcs[0], torch.cat(list(tp_shards), dim))]


def rank_plan(spec: ModelSpec, tp_rank: int, tp: int, pp_rank: int, pp: int,
              head: str = "lm") -> dict[str, list[Slice]]:
    """For rank (tp_rank, pp_rank): global megatron name -> the HF slices it reads to build it."""
    per = spec.num_layers // pp
    layers = range(pp_rank * per, (pp_rank + 1) * per)
    names = megatron_names(spec, layers, pp_rank == 0, pp_rank == pp - 1, head)
    return {n: hf_slices(n, spec, tp_rank, tp, head) for n in names}


# -- megatron distributed-checkpoint keys ---------------------------------------------------------------
# megatron's sharded state dict names the layer norms after the Transformer-Engine spec and stacks
# the layers on a leading axis: `decoder.layers.<suffix>` of shape [num_layers, ...].
_CKPT_SUFFIX = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def checkpoint_to_hf(tensors: Mapping[str, torch.Tensor], spec: ModelSpec,
                     head: str = "lm") -> list[tuple[str, torch.Tensor]]:
    """HF tensors from whole tensors keyed as in a megatron distributed checkpoint (what
    `load_plain_tensors` returns). Each tensor there is the concatenation of its TP shards in
    megatron's TP-independent layout, so it converts as a single TP=1 shard."""
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("decoder.layers."):
            suffix = key[len("decoder.layers."):]
            suffix = _CKPT_SUFFIX.get(suffix, suffix)
            if value.shape[0] != spec.num_layers:
                raise ValueError(f"checkpoint tensor {key} stacks {value.shape[0]} layers; the config has "
                                 f"{spec.num_layers}")
            expert = suffix.startswith("mlp.experts.experts.")   # [layers, global experts, ...]
            for n in range(spec.num_layers):
                if expert:
                    leaf = suffix[len("mlp.experts.experts."):]
                    for e in range(value.shape[1]):
                        out += megatron_to_hf(f"decoder.layers.{n}.mlp.experts.local_experts.{e}.{leaf}",
                                              [value[n][e]], spec, head)
                    continue
                out += megatron_to_hf(f"decoder.layers.{n}.{suffix}", [value[n]], spec, head)
        elif key in (EMBED, FINAL_NORM, OUTPUT):
            out += megatron_to_hf(key, [value], spec, head)
        else:
            raise ValueError(f"checkpoint tensor {key} has no HF counterpart in megarl's map")
    return out
