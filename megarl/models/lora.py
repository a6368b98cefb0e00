"""LoRA on megatron's tensor-parallel linears: the `lora` model converter (megarl/models/converters.py).

    actor_rollout_ref.model.lora_rank=16 lora_alpha=32 target_modules=all-linear   # turns it on

For each targeted linear y = W x an adapter adds (alpha / r) * B A x. The base weights are frozen,
so only A and B get gradients and optimizer state. The adapters are named as PEFT names them
(q_proj ... down_proj, one A/B pair per HF projection) and laid out per TP rank as
megarl/models/convert.py lays the fused weights out:

    linear_qkv  (column)  A_p [r, h] whole on every TP rank; B_p [rows_p / T, r], the rows of this
                          rank's query groups; outputs interleaved per group [q.., k, v]
    linear_fc1  (column)  A_p [r, h]; B_p [f / T, r]; outputs [gate_r; up_r]
    linear_proj (row)     A [r, in / T] split along the input; B [h, r] whole
    linear_fc2  (row)     the same

A column adapter's A sees every rank's B through an all-reduce of its gradient (or, with sequence
parallel, a gather of A x over the sequence); a row adapter sums its partial A x over TP before B.
The adapters sit beside their linear (`linear_qkv_lora` next to `linear_qkv`), run from a forward
hook, so the base parameter names, megatron's checkpoint keys and the HF maps stay unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers as tpl
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from megarl.models.converters import ConverterHooks, Exports, register_converter
from megarl.models.lora_options import LINEARS, SUFFIX, LoraOptions, is_adapter_name, parse_targets, peft_key


class LoraAdapter(nn.Module):
    """The adapters of one megatron linear (one A/B pair per targeted HF projection)."""

    def __init__(self, linear: nn.Module, kind: str, rows: dict[str, int], groups: int, layer: int,
                 opts: LoraOptions):
        """rows: the full output size (HF rows) of each projection the linear fuses; groups: the
        query groups on this rank (linear_qkv), else 1."""
        super().__init__()
        parts = {p: n for p, n in rows.items() if p in opts.target_modules}
        self.kind, self.parts, self.groups, self.layer = kind, tuple(parts), groups, layer
        self.column = LINEARS[kind][2]
        self.scale, self.enabled = opts.scale, True
        self.dropout = nn.Dropout(opts.dropout) if opts.dropout > 0 else nn.Identity()
        self.sequence_parallel = bool(linear.sequence_parallel)
        self.tp_group = linear.tp_group
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        weight = linear.weight
        # this rank's rows of each fused projection (the fused output's layout, adapted or not)
        self.local_rows = {p: n // tp for p, n in rows.items()}
        full_in = linear.input_size
        for part, rows in parts.items():   # rows: the projection's full output size (HF rows)
            # A starts as PEFT's kaiming-uniform, drawn whole from a seed of (layer, projection) so
            # every layout draws the same adapter; B starts at zero (the base model unchanged).
            g = torch.Generator().manual_seed(opts.seed * 1_000_003 + zlib.crc32(f"{layer}.{part}".encode()))
            a = torch.empty(opts.rank, full_in)
            bound = 1 / math.sqrt(full_in)
            a.uniform_(-bound, bound, generator=g)
            if self.column:
                b = torch.zeros(rows // tp, opts.rank)
            else:
                a = a.chunk(tp, dim=1)[tp_rank]
                b = torch.zeros(rows, opts.rank)
            A = nn.Parameter(a.to(weight.device, weight.dtype))
            B = nn.Parameter(b.to(weight.device, weight.dtype))
            # megatron's TP attributes: the split tensor counts once per rank in the grad norm; a
            # whole one (duplicated over TP) once, and with sequence parallel its gradient is a
            # partial sum over this rank's tokens that finalize_model_grads all-reduces over TP.
            split, whole = (B, A) if self.column else (A, B)
            tpl.set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
            tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
            whole.sequence_parallel = self.sequence_parallel
            self.register_parameter(f"A_{part}", A)
            self.register_parameter(f"B_{part}", B)

    def A(self, part: str) -> torch.Tensor:
        return getattr(self, f"A_{part}")

    def B(self, part: str) -> torch.Tensor:
        return getattr(self, f"B_{part}")

    def fuse(self, per_part: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """Per-projection tensors (this rank's rows along `dim`) laid out as the fused linear's
        rows: per query group [q.., k, v] (linear_qkv), [gate; up] (linear_fc1). A projection
        without an adapter contributes zeros."""
        ref = next(iter(per_part.values()))
        cols = []
        for part in LINEARS[self.kind][1]:
            t = per_part.get(part)
            if t is None:
                shape = list(ref.shape)
                shape[dim] = self.local_rows[part]
                t = ref.new_zeros(shape)
            cols.append(t.unflatten(dim, (self.groups, -1)))
        return torch.cat(cols, dim + 1).flatten(dim, dim + 1)

    def forward(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return base
        if not self.column:
            h = self.dropout(x) @ self.A(self.parts[0]).t()                        # [s, b, r] partial over TP
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                 if self.sequence_parallel else mappings.reduce_from_tensor_model_parallel_region(h, self.tp_group))
            return base + self.scale * (h @ self.B(self.parts[0]).t())
        out = {}
        for part in self.parts:
            h = self.dropout(x) @ self.A(part).t()                                  # [s(/T), b, r]
            h = (mappings.gather_from_sequence_parallel_region(h, True, group=self.tp_group)
                 if self.sequence_parallel else mappings.copy_to_tensor_model_parallel_region(h, self.tp_group))
            out[part] = h @ self.B(part).t()                                        # [s, b, rows_p / T]
        return base + self.scale * self.fuse(out, base.dim() - 1)

    def delta(self) -> torch.Tensor:
        """scale * B A in fp32, laid out as this rank's shard of the linear's weight."""
        if not self.column:
            return self.scale * (self.B(self.parts[0]).float() @ self.A(self.parts[0]).float())
        return self.scale * self.fuse({p: self.B(p).float() @ self.A(p).float() for p in self.parts}, 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron's distributed-checkpoint entries: split tensors keyed with their TP axis."""
        sd = self.state_dict(prefix="", keep_vars=True)
        axes = {n: (0 if self.column else 1) for n in sd if n.startswith("B_" if self.column else "A_")}
        return make_sharded_tensors_for_checkpoint(sd, prefix, axes, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _attach(layer: nn.Module, opts: LoraOptions) -> list[LoraAdapter]:
    cfg, added = layer.config, []
    heads, groups, hn = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
    full_rows = {"q_proj": heads * hn, "k_proj": groups * hn, "v_proj": groups * hn, "o_proj": cfg.hidden_size,
                 "gate_proj": cfg.ffn_hidden_size, "up_proj": cfg.ffn_hidden_size, "down_proj": cfg.hidden_size}
    for kind, (where, projections, _) in LINEARS.items():
        if not any(p in opts.target_modules for p in projections):
            continue
        parent = getattr(layer, where)
        linear = getattr(parent, kind)
        if kind == "linear_fc1" and not cfg.gated_linear_unit:
            raise ValueError("LoRA: linear_fc1 without a gated (SwiGLU) MLP is not mapped; target attention only")
        n_groups = groups // linear.tp_group.size() if kind == "linear_qkv" else 1
        adapter = LoraAdapter(linear, kind, {p: full_rows[p] for p in projections}, n_groups, layer.layer_number,
                              opts)
        setattr(parent, kind + SUFFIX, adapter)
        linear.register_forward_hook(_hook(adapter), with_kwargs=True)
        added.append(adapter)
    return added


def _hook(adapter: LoraAdapter):
    def hook(module, args, kwargs, output):
        out, bias = output
        return adapter(args[0] if args else kwargs["input_"], out), bias
    return hook


def adapters(chunks: list[nn.Module]) -> Iterator[LoraAdapter]:
    for m in chunks:
        for mod in m.modules():
            if isinstance(mod, LoraAdapter):
                yield mod


@contextlib.contextmanager
def disabled(chunks: list[nn.Module]):
    """The base model: every adapter off for the duration (the reference policy of a LoRA actor)."""
    mods = list(adapters(chunks))
    for a in mods:
        a.enabled = False
    try:
        yield
    finally:
        for a in mods:
            a.enabled = True


def merged_weights(chunk: nn.Module) -> Exports:
    """{local weight name: () -> W + scale B A} for every adapted linear of one chunk: this rank's
    shard, merged in fp32 from the live parameters when called, cast back to the weight's dtype."""
    out = {}
    for name, mod in chunk.named_modules():
        if isinstance(mod, LoraAdapter):
            parent = name[: -len(mod.kind + SUFFIX)]
            w = chunk.get_submodule(parent + mod.kind).weight
            out[f"{parent}{mod.kind}.weight"] = functools.partial(_merge, w, mod)
    return out


def _merge(w: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    with torch.no_grad():
        return (w.detach().float() + adapter.delta()).to(w.dtype)


def apply_lora(chunks: list[nn.Module], opts: LoraOptions) -> list[LoraAdapter]:
    """Freeze every base parameter and attach adapters to each transformer layer's linears."""
    for m in chunks:
        for p in m.parameters():
            p.requires_grad_(False)
    added = []
    for m in chunks:
        if getattr(m.config, "num_moe_experts", None):
            raise ValueError("LoRA on a mixture-of-experts model is not supported (experts are not adapted); "
                             "set lora_rank=0 or use a dense model")
        for layer in m.decoder.layers:
            added += _attach(layer, opts)
    return added


class Lora(ConverterHooks):
    """The `lora` converter: adapters added and the base frozen; exports and weight syncs read the
    merged weights; the original model is the base with every adapter off."""

    def __init__(self, opts: LoraOptions):
        self.opts = opts

    def __call__(self, chunks: list[nn.Module]) -> None:
        apply_lora(chunks, self.opts)

    def added(self, name: str) -> bool:
        return is_adapter_name(name)

    def exported(self, chunk: nn.Module) -> Exports:
        return merged_weights(chunk)

    def original(self, chunks: list[nn.Module]):
        return disabled(chunks)


@register_converter("lora", checkpoint_label="LoRA",
                    fix="set actor_rollout_ref.model.lora_rank / lora_alpha / target_modules as at the save")
def lora(options: dict) -> Lora:
    opts = LoraOptions(rank=int(options["rank"]), alpha=float(options.get("alpha", options["rank"])),
                       target_modules=parse_targets(options.get("target_modules", "all-linear")),
                       dropout=float(options.get("dropout", 0.0)), seed=int(options.get("seed", 0)))
    if opts.rank <= 0 or not 0 <= opts.dropout < 1:
        raise ValueError(f"lora converter: rank must be > 0 (got {opts.rank}) and dropout in [0, 1) "
                         f"(got {opts.dropout})")
    return Lora(opts)


def saved_options(options) -> LoraOptions:
    """The `lora` entry of a checkpoint's metadata, checked field by field before an export divides
    by its rank or reads its targets: one ValueError naming the field, where a hand-edited or foreign
    entry would otherwise end in a ZeroDivisionError or TypeError deep in the merge."""
    def bad(field: str, value, want: str) -> ValueError:
        return ValueError(f"saved LoRA metadata: lora.{field} is {value!r} ({type(value).__name__}); {want}")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(options, dict):
        raise bad("", options, "expected a mapping of rank, alpha, target_modules")
    rank = options.get("rank")
    if type(rank) is not int or rank <= 0:
        raise bad("rank", rank, "a LoRA rank is a positive integer")
    alpha = options.get("alpha", rank)
    if not number(alpha):
        raise bad("alpha", alpha, "lora_alpha is a finite number")
    dropout = options.get("dropout", 0.0)
    if not number(dropout) or not 0 <= dropout < 1:
        raise bad("dropout", dropout, "lora_dropout is a number in [0, 1)")
    targets = options.get("target_modules", "all-linear")
    if not (isinstance(targets, str) or isinstance(targets, (list, tuple)) and targets
            and all(isinstance(t, str) for t in targets)):
        raise bad("target_modules", targets, "a list of projection names (q_proj ... down_proj) or all-linear")
    try:
        parsed = parse_targets(targets)
    except ValueError as err:
        raise ValueError(f"saved LoRA metadata: lora.{err}") from None
    return LoraOptions(rank=rank, alpha=float(alpha), target_modules=parsed, dropout=float(dropout))


# -- PEFT's names: load and export ------------------------------------------------------------------
def _peft_key(adapter: LoraAdapter, part: str, which: str) -> str:
    return peft_key(adapter.layer - 1, adapter.kind, part, which)


def _split_dim(adapter: LoraAdapter, which: str) -> int | None:
    """The dimension TP splits this tensor along (None: whole on every rank)."""
    if adapter.column:
        return 0 if which == "B" else None
    return 1 if which == "A" else None


def load_peft(chunks: list[nn.Module], tensors) -> None:
    """Copy a PEFT adapter's full tensors (PEFT's keys) into this rank's adapter shards."""
    with torch.no_grad():
        for a in adapters(chunks):
            tp, rank = a.tp_group.size(), a.tp_group.rank()
            for part in a.parts:
                for which in ("A", "B"):
                    full = tensors[_peft_key(a, part, which)]
                    dim = _split_dim(a, which)
                    mine = full if dim is None else full.chunk(tp, dim)[rank]
                    getattr(a, which)(part).copy_(mine)


def peft_tensors(chunks: list[nn.Module], value=lambda p: p.detach()):
    """(PEFT key, full tensor of value(param)) for every adapter of this pipeline stage: TP splits
    all-gathered (a collective over TP; every TP rank yields the same)."""
    for a in adapters(chunks):
        tp = a.tp_group.size()
        for part in a.parts:
            for which in ("A", "B"):
                mine, dim = value(getattr(a, which)(part)).contiguous(), _split_dim(a, which)
                if dim is not None and tp > 1:
                    got = [torch.empty_like(mine) for _ in range(tp)]
                    dist.all_gather(got, mine, group=a.tp_group)
                    mine = torch.cat(got, dim)
                yield _peft_key(a, part, which), mine
