"""Colocated weight sync: the rollout engine lives on the training ranks (the default).

    sync = ColocatedSync(ShardSource.from_actor(actor), engine, bucket_bytes=512 << 20)
    metrics = sync.sync()                 # every rank, after each policy update

For each bucket of pipeline stage p (megarl/checkpoint_engine/plan.py), in the same order on
every rank:
  1. stage p's ranks all-gather, over their TP group, the entries that need it, in place in the
     bucket buffer;
  2. with PP > 1 they broadcast the bucket over their pipeline group (every other stage receives);
  3. every rank turns the buffer into HF tensors, or into its engine's part of them, and loads them.
On gloo each shard is sent straight from its parameter (one broadcast per shard); on NCCL the
shards are first copied into the buffer and move as one all-gather and one broadcast per bucket.
Moving bucket k+1 (async collectives) overlaps step 3 of bucket k. A rank holds at most two
bucket buffers (reused through the sync) and one tensor's conversion, never the whole model.

Where training TP equals rollout TP (and the engine accepts shards, as the native engine does),
each rank's shard already is its engine's part: those tensors skip the all-gather, and with
PP = 1 go from the live parameters straight into the engine.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.checkpoint_engine.base import conclude, metrics
from megarl.checkpoint_engine.memory import PeakMemory
from megarl.checkpoint_engine.pipeline import Transfer, run_pipeline
from megarl.checkpoint_engine.plan import Bucket, build_plan, local_names, stage_names
from megarl.checkpoint_engine.delta_sync import delta_options
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.transport import BuildParts
from megarl.checkpoint_engine.stream import bucket_stream, feed, takes_shards
from megarl.config.errors import ConfigError
from megarl.rollout.base import RolloutEngine, ShardSlice

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_in_place(buf: torch.Tensor, rank: int, size: int, group, async_op: bool = True) -> list:
    """All-gather the `size` equal slots of `buf` (slot `rank` filled here) over `group`, in place.
    NCCL: one all-gather. gloo: one broadcast per slot, which measured 3-4x faster than gloo's
    all-gather on this kind of machine and, unlike it, allocates no second output buffer."""
    if dist.get_backend(group) == "nccl":
        n = buf.numel() // size
        return [_all_gather(buf, buf[rank * n:(rank + 1) * n], group=group, async_op=async_op)]
    return [dist.broadcast(part, src=dist.get_global_rank(group, r), group=group, async_op=async_op)
            for r, part in enumerate(buf.chunk(size))]


class _Buffers:
    """Bucket buffers for one sync: `slots` reusable ones (the bucket loading, the one in flight),
    so memory pages are touched once per sync rather than once per bucket; a bucket larger than
    a slot (one tensor bigger than the bucket size) gets a buffer of its own."""

    def __init__(self, numel: int, slots: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.taken = 0

    def take(self, numel: int) -> torch.Tensor:
        if numel > self.numel:
            return torch.empty(numel, dtype=self.dtype, device=self.device)
        i = self.taken % len(self.slots)
        self.taken += 1
        if self.slots[i] is None:
            self.slots[i] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.slots[i][:numel]


class ColocatedSync:
    def __init__(self, source: ShardSource, engine: RolloutEngine, bucket_bytes: int = 512 << 20,
                 overlap: bool = True, group=None, direct: bool | None = None):
        self.src, self.engine, self.overlap, self.group = source, engine, overlap, group
        # direct: send shards straight from the parameters (default on gloo; see _packed)
        self.direct = (not dist.is_initialized() or dist.get_backend() != "nccl") if direct is None else direct
        self.bucket_bytes = bucket_bytes
        self.dtype, self.device = source.dtype, source.device
        spec, head = source.spec, source.head
        self.want = takes_shards(engine)
        want = self.want or (lambda name: ShardSlice())
        names = [n for p in range(source.pp) for n in stage_names(spec, source.pp, p, head, source.vpp)]
        mine = local_names(spec, source.tp, source.tp_rank, source.pp, want, head, source.vpp)
        # A tensor skips the all-gather only if it may on every rank (collectives must agree).
        flags = torch.tensor([int(n in mine) for n in names], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        local = {n for n, f in zip(names, flags.tolist()) if f}
        self.plan = build_plan(spec, source.tp, source.pp, bucket_bytes, self.dtype.itemsize, local, head,
                               vpp=source.vpp)
        self.stage_src = [source.stage_rank(p) for p in range(source.pp)]
        self._buffers: _Buffers | None = None
        self._check_same_plan()

    def _check_same_plan(self) -> None:
        if not dist.is_initialized():
            return
        digests = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, self.plan.digest(), group=self.group)
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks built different weight-sync plans ({sorted(set(digests))}); every rank must "
                               "run the same config and model")

    # -- moving one bucket --------------------------------------------------------------------------
    def _packed(self, bucket: Bucket) -> bool:
        """Copy this rank's shards into the buffer and move whole slots (NCCL: one all-gather, one
        broadcast), or send each shard straight from its parameter (gloo: saves the copy, which
        on a CPU costs as much memory bandwidth as the transfer). A gathered tensor alone in its
        bucket is always packed: its full buffer is then the full tensor (no conversion copy)."""
        alone = len(bucket.entries) == 1 and bucket.entries[0].gather
        return not self.direct or alone

    def _segments(self, bucket: Bucket, buf: torch.Tensor):
        """(entry, TP slot or None for a local entry, its view of the buffer), in wire order."""
        T, G = self.src.tp, bucket.gather_numel
        for e in bucket.entries:
            if e.gather:
                for r in range(T):
                    yield e, r, buf[r * G + e.offset: r * G + e.offset + e.numel]
            elif self.src.pp > 1:
                yield e, None, buf[T * G + e.offset: T * G + e.offset + e.numel]

    def _start(self, bucket: Bucket) -> Transfer:
        src, T = self.src, self.src.tp
        numel = bucket.numel(T, with_local=src.pp > 1)   # PP = 1: local entries come from the params
        if numel == 0:
            return Transfer(None)
        buf = self._buffers.take(numel)
        stage_rank, packed = self.stage_src[bucket.stage], self._packed(bucket)
        segments = list(self._segments(bucket, buf))
        if bucket.stage != src.pp_rank:  # another stage's bucket: receive it
            views = [buf] if packed else [v for _, _, v in segments]
            return Transfer(buf, [dist.broadcast(v, src=stage_rank, group=src.pp_group, async_op=True)
                                   for v in views])
        G = bucket.gather_numel
        # What this rank sends for each segment: its own shard (from the parameter unless packed).
        sent = []
        for e, r, view in segments:
            mine = r is None or r == src.tp_rank
            if mine and packed:
                view.copy_(src.params[e.name].reshape(-1))
            sent.append(src.params[e.name].reshape(-1) if mine and not packed else view)
        filling = []
        if G and T > 1:
            if packed:
                filling = gather_in_place(buf[:T * G], src.tp_rank, T, src.tp_group)
            else:
                filling = [dist.broadcast(t, src=dist.get_global_rank(src.tp_group, r), group=src.tp_group,
                                          async_op=True) for (e, r, _), t in zip(segments, sent) if r is not None]
        then = None
        if src.pp > 1:
            def then():
                return [dist.broadcast(t, src=stage_rank, group=src.pp_group, async_op=True)
                        for t in ([buf] if packed else sent)]
        return Transfer(buf, filling, then)

    def _load(self, bucket: Bucket, buf: torch.Tensor | None) -> None:
        own = self.src.params if bucket.stage == self.src.pp_rank else None
        stream = bucket_stream(self.plan, bucket, buf, self.src.tp_rank, own, self.want)
        feed(self.engine, stream, self.want is not None)

    # -- one sync -----------------------------------------------------------------------------------
    def request_anchor(self, why: str) -> None:
        """Nothing to do: every colocated sync sends the whole model (no deltas to re-anchor)."""

    def sync(self) -> dict[str, float]:
        with self.src.all_experts():      # MoE under EP: every expert, for this sync
            return self._sync()

    def _sync(self) -> dict[str, float]:
        """Collective: every rank calls it. Raises WeightSyncError (on every rank) if any failed."""
        buckets = self.plan.buckets
        start = time.perf_counter()
        sizes = [b.numel(self.src.tp, self.src.pp > 1) for b in buckets]
        slot = max([n for n in sizes if n * self.dtype.itemsize <= self.bucket_bytes] + [0])
        self._buffers = _Buffers(slot, 2 if self.overlap else 1, self.dtype, self.device)
        with torch.no_grad(), PeakMemory(self.device) as mem:
            try:
                error, wire = run_pipeline(buckets, self._start, self._load, overlap=self.overlap,
                                           abort=self.engine.abort_weight_update)
            finally:
                self._buffers = None
        seconds = time.perf_counter() - start
        seconds, peak = conclude(self.engine, error, [seconds, mem.extra_mb], self.group, self.device)
        return metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(buckets), peak, wire)


def build_colocated(p: BuildParts) -> ColocatedSync:
    """This rank's colocated sync (registered in transports/colocated.py)."""
    ce, ro = p.cfg.rollout.checkpoint_engine, p.cfg.rollout
    source = ShardSource.from_actor(p.actor)
    delta_options(ce, source.dtype, "colocated")          # delta=auto: says in the log that it is off here
    if p.engine is None:
        raise ValueError("backend=colocated needs the rollout engine of this rank (build_rollout(...))")
    if p.rollout_group is not None and dist.get_world_size(p.rollout_group) != ro.tensor_model_parallel_size:
        raise ConfigError(f"the rollout group has {dist.get_world_size(p.rollout_group)} ranks, the config says "
                          f"{ro.tensor_model_parallel_size}", "actor_rollout_ref.rollout.tensor_model_parallel_size")
    return ColocatedSync(source, p.engine, int(ce.bucket_size_mb * 2**20), overlap=ce.overlap)
