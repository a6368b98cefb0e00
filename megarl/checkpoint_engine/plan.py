"""The transfer plan: which megatron shard goes where, computed once and reused every sync.

    plan = build_plan(spec, tp=2, pp=2, bucket_bytes=512 << 20, element_size=4, local=names)
    for b in plan.buckets:            # in the same order on every rank
        b.stage, b.entries, b.numel(tp)

Pure (no process groups, no I/O). A bucket holds megatron tensors of one pipeline stage. Each
entry is either *gathered* (its TP shards are all-gathered, then converted to full HF tensors
with convert.megatron_to_hf) or *local* (each TP rank's own shard already holds what every
engine rank fed from it needs: replicated norms always; split tensors when the engine's shard
of every HF piece lies inside the trainer's, e.g. training TP = rollout TP). A bucket's buffer
is laid out as

    [ TP rank 0's gathered entries | TP rank 1's ... | local entries ]     (elements, flat)

so one all-gather fills the first part in place (on gloo: one broadcast per shard) and a
broadcast moves the bucket to the other pipeline stages.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from megarl.models.convert import (EMBED, OUTPUT, Slice, hf_names, hf_shapes, hf_slices, megatron_names,
                                   megatron_to_hf, shard_shape, tp_dim)
from megarl.models.spec import ModelSpec, stage_layers
from megarl.rollout.base import ShardSlice


@dataclass(frozen=True)
class Entry:
    name: str                              # global megatron name
    shape: tuple[int, ...]                 # one TP rank's shard
    gather: bool                           # all-gather over TP first; else each rank's own shard suffices
    offset: int                            # element offset within its region of the bucket buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    index: int
    stage: int                             # the pipeline stage that holds these tensors
    entries: tuple[Entry, ...]
    gather_numel: int                      # elements one TP rank adds to the all-gather
    local_numel: int                       # elements of the local entries

    def numel(self, tp: int, with_local: bool = True) -> int:
        return tp * self.gather_numel + (self.local_numel if with_local else 0)


@dataclass(frozen=True)
class TransferPlan:
    spec: ModelSpec
    tp: int
    pp: int
    head: str
    buckets: tuple[Bucket, ...]

    def hf_names(self) -> list[str]:
        """Every HF tensor one sync delivers, in delivery order."""
        return [h for b in self.buckets for e in b.entries for h in hf_names(e.name, self.spec, self.head)]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every HF tensor the plan delivers (vocabulary padding excluded)."""
        every = hf_shapes(self.spec, self.head)
        return {h: every[h] for h in self.hf_names()}

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.hf_shapes().values())

    def digest(self) -> str:
        """Identical on every rank that built the same plan (checked before the first sync)."""
        text = repr((self.tp, self.pp, self.head, [(b.stage, b.entries) for b in self.buckets]))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


# -- names per stage ------------------------------------------------------------------------------
def stage_names(spec: ModelSpec, pp: int, stage: int, head: str = "lm", vpp: int = 1) -> list[str]:
    """The megatron tensors a sync reads from pipeline stage `stage` (all its virtual-pipeline
    chunks). A tied LM's last-stage copy of the embedding (output_layer under PP > 1) is skipped:
    the first stage sends it."""
    names = megatron_names(spec, stage_layers(spec, stage, pp, vpp), stage == 0, stage == pp - 1, head)
    if head == "lm" and spec.tie_word_embeddings:
        names = [n for n in names if n != OUTPUT]
    return names


# -- which tensors can skip the all-gather --------------------------------------------------------
def contains(outer: Slice, inner: ShardSlice) -> bool:
    """Does the trainer's piece `outer` of an HF tensor hold the engine's part `inner`?"""
    if outer.dim is None:
        return True
    if inner.dim is None:
        return False
    return inner.dim == outer.dim and outer.start <= inner.start and inner.stop <= outer.stop


def narrow_to(piece: torch.Tensor, outer: Slice, inner: ShardSlice) -> torch.Tensor:
    """The engine's part `inner` out of `piece` (which covers `outer` of the full tensor): a view."""
    if inner.dim is None:
        return piece
    start = inner.start - (outer.start if outer.dim is not None else 0)
    return piece.narrow(inner.dim, start, inner.stop - inner.start)


def local_names(spec: ModelSpec, tp: int, tp_rank: int, pp: int, want: Callable[[str], ShardSlice],
                head: str = "lm", vpp: int = 1) -> set[str]:
    """Megatron tensors (of every stage: other stages' shards reach this rank by broadcast) whose
    TP shard `tp_rank` holds this rank's engine part of each of its HF tensors."""
    out = set()
    for stage in range(pp):
        for name in stage_names(spec, pp, stage, head, vpp):
            if all(contains(s, want(s.hf_name)) for s in hf_slices(name, spec, tp_rank, tp, head)):
                out.add(name)
    return out


# -- the plan -------------------------------------------------------------------------------------------
def is_vocab(name: str, head: str = "lm") -> bool:
    """Split over the vocabulary (dim 0, padded): the embedding and the LM head."""
    return name == EMBED or (name == OUTPUT and head == "lm")


def build_plan(spec: ModelSpec, tp: int, pp: int, bucket_bytes: int, element_size: int,
               local: Collection[str] = (), head: str = "lm", gather_all: bool = False,
               vpp: int = 1) -> TransferPlan:
    """Buckets of at most `bucket_bytes` (counting gathered entries at their full size; a tensor
    larger than that gets a bucket of its own), stage by stage in megatron's parameter order.
    `local`: split tensors that need no all-gather; replicated ones never do. `gather_all`: every
    entry is laid out as gathered (the disaggregated transport, whose receivers hold no shard)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[Bucket] = []
    for stage in range(pp):
        entries: list[Entry] = []
        g_off = l_off = size = 0

        def close():
            nonlocal entries, g_off, l_off, size
            if entries:
                buckets.append(Bucket(len(buckets), stage, tuple(entries), g_off, l_off))
            entries, g_off, l_off, size = [], 0, 0, 0

        for name in stage_names(spec, pp, stage, head, vpp):
            shape = shard_shape(name, spec, tp, head)
            gather = gather_all or (tp > 1 and tp_dim(name, head, spec) is not None and name not in local)
            n = math.prod(shape)
            nbytes = (tp * n if gather else n) * element_size
            # A gathered vocabulary tensor (usually the largest) gets a bucket of its own: its
            # gathered region then *is* the full padded tensor, and converting it copies nothing.
            alone = gather and is_vocab(name, head)
            if entries and (alone or size + nbytes > bucket_bytes):
                close()
            entries.append(Entry(name, tuple(shape), gather, g_off if gather else l_off))
            if gather:
                g_off += n
            else:
                l_off += n
            size += nbytes
            if alone:
                close()
        close()
    return TransferPlan(spec, tp, pp, head, tuple(buckets))


# -- from shards to HF tensors ----------------------------------------------------------------------
def split_shard(name: str, shard: torch.Tensor, spec: ModelSpec, tp_rank: int, tp: int,
                head: str = "lm") -> list[tuple[Slice, torch.Tensor]]:
    """One TP rank's shard of megatron tensor `name` -> the HF pieces it holds, each with the
    Slice of the full HF tensor it covers (convert.hf_slices). The inverse of convert.assemble;
    vocabulary padding is dropped."""
    slices = hf_slices(name, spec, tp_rank, tp, head)
    if name in (EMBED, OUTPUT) and slices[0].dim == 0:
        s = slices[0]
        return [(s, shard[: s.stop - s.start])]
    if len(slices) == 1:
        return [(slices[0], shard)]
    if len(slices) == 2:                   # fc1: [gate_r; up_r]
        gate, up = shard.chunk(2, dim=0)
        return [(slices[0], gate), (slices[1], up)]
    groups, hn, qpg = spec.num_kv_heads // tp, spec.head_dim, spec.q_per_group
    tail = shard.shape[1:]                 # (h,) for the weight, () for the bias
    grouped = shard.view(groups, qpg + 2, hn, *tail)      # per KV group: its q heads, then k, then v
    q = grouped[:, :qpg].reshape(-1, *tail)
    k = grouped[:, qpg].reshape(-1, *tail)
    v = grouped[:, qpg + 1].reshape(-1, *tail)
    return list(zip(slices, (q, k, v)))


def gathered_to_hf(name: str, shards: list[torch.Tensor], spec: ModelSpec, head: str = "lm",
                   joined: torch.Tensor | None = None) -> list[tuple[Slice, torch.Tensor]]:
    """All TP shards of `name` -> full HF tensors, each with a whole-tensor Slice. `joined`: the
    shards already adjacent in memory (a bucket of its own), used as a view instead of a copy."""
    if joined is not None and is_vocab(name, head):
        full = joined.view(-1, *shards[0].shape[1:])[: spec.vocab_size]      # [V, h], padding dropped
        return [(Slice(hf_names(name, spec, head)[0]), full)]
    return [(Slice(h), t) for h, t in megatron_to_hf(name, shards, spec, head)]
