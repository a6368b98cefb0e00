"""Disaggregated weight sync: the rollout engine runs on ranks of its own, and the buckets cross
bridges (megarl/parallel/bridge.py) that span the trainer's ranks and the engine's.

    # every rank of the job (each builds the bridges it belongs to):
    groups = DisaggregatedGroups.create(tp=2, pp=1, trainer_rank=megatron_rank_fn, engine_ranks=[2, 3],
                                        store=store, rank=global_rank, everyone=world_bridge)
    # trainer ranks (megatron shards):
    sender = DisaggregatedSender(source, groups, bucket_bytes=512 << 20)
    # engine ranks (one rollout engine per rank; its own TP group inside):
    receiver = DisaggregatedReceiver(engine, spec, groups, dtype=torch.float32, bucket_bytes=512 << 20)
    metrics = sender.sync()  /  receiver.sync()   # collective: both sides, after each policy update

The plan is the colocated one with every entry laid out as gathered (the engine holds no shard).
For each bucket of stage p, TP rank t of stage p in DP replica 0 broadcasts its shards of the
bucket over group (t, p) = {that trainer rank} + every engine rank. The T broadcasts of a bucket
run at once, on different groups, so engine ranks receive from T senders in parallel; the next
bucket is posted before the engine loads this one. DP replicas other than 0 send nothing.

How a job uses it (rollout.placement=disaggregated, megarl/job/ranks.py): trainer ranks are
[0, N) with megatron's layout over them only, engine ranks [N, world); each side is a
torch.distributed job of its own, and only bridges reach across. The transport itself takes
any rank numbering through `trainer_rank(t, dp, p)`. With `keep_previous` the receiver holds the
last complete weights and reloads them when a sync fails (the engine keeps generating on them).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.checkpoint_engine.base import conclude, metrics
from megarl.checkpoint_engine.delta_sync import (DeltaOptions, Incoming, ReceiverDelta, SenderDelta, decide,
                                                 delta_options, layout_index, layouts_of)
from megarl.checkpoint_engine.errors import WeightSyncError
from megarl.checkpoint_engine.memory import PeakMemory
from megarl.checkpoint_engine.pipeline import Transfer, run_pipeline
from megarl.checkpoint_engine.plan import TransferPlan, build_plan
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.stream import bucket_stream, feed, takes_shards
from megarl.checkpoint_engine.transport import BuildParts
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.models.spec import ModelSpec
from megarl.parallel.bridge import Bridge
from megarl.rollout.base import RolloutEngine, rollout_dtype

log = logging.getLogger(__name__)


def megatron_rank(t: int, d: int, p: int, tp: int, dp: int) -> int:
    """Global rank of (TP rank t, DP rank d, stage p) in megatron-core's default order (tp-dp-pp)."""
    return t + tp * (d + dp * p)


@dataclass
class DisaggregatedGroups:
    tp: int
    pp: int
    senders: dict[tuple[int, int], int]    # (t, p) -> the trainer rank that sends those shards
    groups: dict[tuple[int, int], Bridge]  # (t, p) -> {sender} + engine ranks (only those this rank is in)
    engine_ranks: list[int]
    everyone: Bridge                       # every rank of both sides
    rank: int                              # this rank's global rank

    @classmethod
    def create(cls, tp: int, pp: int, trainer_rank: Callable[[int, int, int], int], engine_ranks: list[int],
               store, rank: int, everyone: Bridge, device: torch.device | str = "cpu", tag: str = "sync",
               timeout_s: float = 600.0) -> "DisaggregatedGroups":
        """Every rank of the job calls this, identically. `trainer_rank(t, dp, p)` gives the global
        rank of a training shard, e.g. lambda t, d, p: megatron_rank(t, d, p, tp, dp); `tag` names
        this set of bridges in the store (one tag per set)."""
        senders, groups = {}, {}
        for p in range(pp):
            for t in range(tp):
                senders[(t, p)] = trainer_rank(t, 0, p)
                if senders[(t, p)] in engine_ranks:
                    raise ValueError(f"trainer rank {senders[(t, p)]} is also an engine rank; the two sides "
                                     "of a disaggregated sync must not overlap")
                members = [senders[(t, p)], *engine_ranks]
                if rank in members:
                    groups[(t, p)] = Bridge(store, f"{tag}/{t}.{p}", members, rank, device, timeout_s)
        return cls(tp, pp, senders, groups, list(engine_ranks), everyone, rank)


def disaggregated_plan(spec: ModelSpec, tp: int, pp: int, bucket_bytes: int, dtype: torch.dtype,
                       head: str = "lm") -> TransferPlan:
    return build_plan(spec, tp, pp, bucket_bytes, dtype.itemsize, (), head, gather_all=True)


def _check_same(plan: TransferPlan, dtype: torch.dtype, group, delta: bool = False) -> None:
    mine = f"{plan.digest()}/{dtype}/delta={delta}"
    every = group.all_gather_object(mine)
    if len(set(every)) != 1:
        raise RuntimeError(f"trainer and engine ranks built different weight-sync plans ({sorted(set(every))}): "
                           "they must use the same model config, layout, bucket size, dtype and delta mode")


def _delta_metrics(out: dict, anchor: bool, changed: float, copy_bytes: float) -> dict:
    out.update({"weight_sync/anchor": float(anchor), "weight_sync/changed_frac": changed,
                "weight_sync/delta_copy_mb": copy_bytes / 2**20})
    return out


class DisaggregatedSender:
    """`dtype`: what crosses the wire (the engine's; default the shards'). `delta`: send only what
    changed (megarl/checkpoint_engine/delta_sync.py); the receivers must be built with it too."""

    def __init__(self, source: ShardSource, groups: DisaggregatedGroups, bucket_bytes: int = 512 << 20,
                 dtype: torch.dtype | None = None, delta: DeltaOptions | None = None):
        if source.vpp > 1:
            raise ValueError("the disaggregated sync plans stages without virtual-pipeline chunks; train with "
                             "virtual_pipeline_model_parallel_size=null or use the colocated sync")
        if (source.tp, source.pp) != (groups.tp, groups.pp):
            raise ValueError(f"groups were built for TP {groups.tp} x PP {groups.pp}, the shards are "
                             f"TP {source.tp} x PP {source.pp}")
        self.src, self.g = source, groups
        self.dtype, self.device = dtype or source.dtype, source.device
        self.plan = disaggregated_plan(source.spec, source.tp, source.pp, bucket_bytes, self.dtype, source.head)
        key = (source.tp_rank, source.pp_rank)
        self.sends = source.dp_rank == 0 and groups.senders[key] == groups.rank
        _check_same(self.plan, self.dtype, groups.everyone, delta is not None)
        self.delta = None
        if delta is not None:
            layouts = layouts_of(groups.everyone.all_gather_object({"layout": None}))
            self.delta = SenderDelta(self.plan, source.tp_rank, self.dtype, delta, layouts)

    def delta_copy_bytes(self) -> int:
        """Host memory this rank's last-sent copy takes once every bucket went out (delta mode)."""
        mine = [b for b in self.plan.buckets if self.sends and b.stage == self.src.pp_rank]
        return self.delta.planned_bytes(mine) if self.delta is not None else 0

    def request_anchor(self, why: str) -> None:
        """Make the next sync full (delta mode), e.g. after the trainer resumed from a checkpoint."""
        if self.delta is not None:
            self.delta.request_anchor(why)

    def sync(self) -> dict[str, float]:
        with self.src.all_experts():      # MoE under EP: every expert, for this sync
            if self.delta is None:
                return self._sync(self._start)
            return self._delta_sync()

    def _sync(self, start_bucket, extra=lambda: []) -> dict[str, float]:
        src = self.src
        mine = [b for b in self.plan.buckets if self.sends and b.stage == src.pp_rank]
        start = time.perf_counter()
        with torch.no_grad(), PeakMemory(self.device) as mem:
            # Nothing to load here: each bucket's send is waited for once the next one is posted
            # (at most two buckets on the move).
            _, wire = run_pipeline(mine, start_bucket, lambda bucket, buf: None, overlap=True, abort=lambda: None)
        seconds, peak, wire, *more = conclude(None, None, [time.perf_counter() - start, mem.extra_mb, float(wire),
                                                           *extra()], self.g.everyone, self.device)
        out = metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(self.plan.buckets), peak, wire)
        return out if not more else _delta_metrics(out, *more)

    def _delta_sync(self) -> dict[str, float]:
        d = self.delta
        reports = self.g.everyone.all_gather_object(d.report())
        anchor, why, version = decide(reports)
        if anchor and self.g.rank == self.g.senders[(0, 0)]:
            log.info(f"weight sync {version}: full (anchor): {why}")
        d.changed = d.total = 0
        try:
            out = self._sync(self._start_anchor if anchor else self._start_delta,
                             lambda: [float(anchor), 1.0 if anchor else d.changed / max(d.total, 1),
                                      float(d.copy_bytes())])
        except WeightSyncError:
            d.concluded(False, anchor, version, [])
            raise
        d.concluded(True, anchor, version, sorted(r["gen"] for r in reports if r["side"] == "engine"))
        return out

    def _start_anchor(self, bucket) -> Transfer:
        self.delta.keep(bucket, self.src.params)
        return self._start(bucket)

    def _start_delta(self, bucket) -> Transfer:
        key = (self.src.tp_rank, self.src.pp_rank)
        head, payload = self.delta.frame(bucket, self.src.params)
        group, src = self.g.groups[key], self.g.senders[key]
        head, payload = head.to(self.device), payload.to(self.device)
        works = [group.broadcast(head, src=src, async_op=True)]
        if payload.numel():                 # the receiver posts no broadcast for an empty frame
            works.append(group.broadcast(payload, src=src, async_op=True))
        return Transfer(payload, sending=works)

    def _start(self, bucket) -> Transfer:
        """Copy this rank's shards of `bucket` into a buffer and broadcast it to the engine ranks."""
        key = (self.src.tp_rank, self.src.pp_rank)
        buf = torch.empty(bucket.gather_numel, dtype=self.dtype, device=self.device)
        for e in bucket.entries:
            buf[e.offset:e.offset + e.numel].copy_(self.src.params[e.name].reshape(-1))
        work = self.g.groups[key].broadcast(buf, src=self.g.senders[key], async_op=True)
        return Transfer(buf, sending=[work])


class DisaggregatedReceiver:
    """`keep_previous`: hold the last complete update's buckets in host memory; when a later sync
    fails on any rank, every engine reloads them (no communication) and goes on generating on its
    previous weights instead of refusing to (an in-place engine cannot otherwise undo a part-way
    load)."""

    def __init__(self, engine: RolloutEngine, spec: ModelSpec, groups: DisaggregatedGroups, dtype: torch.dtype,
                 bucket_bytes: int = 512 << 20, head: str = "lm", device: torch.device | str = "cpu",
                 overlap: bool = True, keep_previous: bool = False, delta: DeltaOptions | None = None):
        self.engine, self.g, self.dtype, self.device, self.overlap = (engine, groups, dtype, torch.device(device),
                                                                      overlap)
        self.plan = disaggregated_plan(spec, groups.tp, groups.pp, bucket_bytes, dtype, head)
        self.want = takes_shards(engine)
        self.keep_previous = keep_previous
        self.previous: list[torch.Tensor] | None = None   # one buffer per bucket, host memory
        _check_same(self.plan, dtype, groups.everyone, delta is not None)
        self.delta = None
        if delta is not None:
            if keep_previous:       # a delta keeps an undo log instead (anchors keep nothing)
                self.keep_previous = False
            self.delta = ReceiverDelta(engine, self.plan, groups.tp, dtype)
            self.delta.undo_on_failure = keep_previous
            gathered = groups.everyone.all_gather_object({"layout": self.delta.layout})
            self.delta.index = layout_index(self.delta.layout, gathered)
            self.delta.n_layouts = len(layouts_of(gathered))

    def replace_engine(self, engine: RolloutEngine) -> None:
        """This rank's engine was rebuilt (restarted after a fault, or a new one joined in its place):
        sync into `engine` from now on. In delta mode it gets a new generation id, so the next sync
        is full on every rank."""
        self.engine, self.want, self.previous = engine, takes_shards(engine), None
        if self.delta is not None:
            old = self.delta
            self.delta = ReceiverDelta(engine, self.plan, self.g.tp, self.dtype)
            self.delta.index, self.delta.n_layouts, self.delta.undo_on_failure = (old.index, old.n_layouts,
                                                                                   old.undo_on_failure)

    def request_anchor(self, why: str) -> None:
        """Nothing to do here: the trainer ranks decide anchors (every sync starts with both sides'
        reports), and a receiver whose state changed says so in its report (replace_engine)."""

    def _restore(self) -> bool:
        """Reload the previous complete weights into the engine (after a failed sync)."""
        if self.previous is None:
            return False
        for bucket, buf in zip(self.plan.buckets, self.previous):
            feed(self.engine, bucket_stream(self.plan, bucket, buf.to(self.device), 0, None, self.want),
                 self.want is not None)
        self.engine.finalize_weights()
        return True

    def _start(self, bucket) -> Transfer:
        G = bucket.gather_numel
        buf = torch.empty(self.g.tp * G, dtype=self.dtype, device=self.device)
        works = [self.g.groups[(t, bucket.stage)].broadcast(buf[t * G:(t + 1) * G],
                                                            src=self.g.senders[(t, bucket.stage)], async_op=True)
                 for t in range(self.g.tp)]
        return Transfer(buf, filling=works)

    def sync(self) -> dict[str, float]:
        if self.delta is None:
            return self._full_sync()
        d = self.delta
        reports = self.g.everyone.all_gather_object(d.report())
        anchor, _, version = decide(reports)
        try:
            out = self._full_sync([1.0, 0.0, 0.0]) if anchor else self._delta_sync()
        except WeightSyncError:
            d.applied = -1
            raise
        d.applied = version
        return out

    def _delta_sync(self) -> dict[str, float]:
        d, heads = self.delta, {}
        heads_per = 4 + 2 * d.n_layouts

        def start(bucket) -> Transfer:
            got = Incoming(self.g, bucket, heads_per, self.device)
            heads[bucket.index] = got.heads
            return got

        def load(bucket, buf) -> None:
            d.load(bucket, buf, heads.pop(bucket.index))

        begin = time.perf_counter()
        with torch.no_grad(), PeakMemory(self.device) as mem:
            try:
                d.begin(d.undo_on_failure)
                error = None
            except Exception as err:  # noqa: BLE001 - reported on every rank by conclude()
                error = err
            err2, wire = run_pipeline(self.plan.buckets, start, (lambda b, buf: None) if error else load,
                                      overlap=self.overlap, abort=self.engine.abort_weight_update)
        try:
            seconds, peak, wire, *more = conclude(self.engine, error or err2,
                                                  [time.perf_counter() - begin, mem.extra_mb, float(wire),
                                                   0.0, 0.0, 0.0],
                                                  self.g.everyone, self.device)
        except WeightSyncError as err:
            if d.restore():
                raise WeightSyncError(f"{err}; this engine undid the delta and generates on its previous "
                                      "weights") from None
            raise
        out = metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(self.plan.buckets), peak, wire)
        return _delta_metrics(out, *more)

    def _full_sync(self, extra: list[float] = ()) -> dict[str, float]:
        buckets = self.plan.buckets
        kept: list[torch.Tensor] = []

        def load(bucket, buf: torch.Tensor) -> None:
            if self.keep_previous:
                kept.append(buf if self.device.type == "cpu" else buf.to("cpu"))
            feed(self.engine, bucket_stream(self.plan, bucket, buf, 0, None, self.want), self.want is not None)

        start = time.perf_counter()
        with torch.no_grad(), PeakMemory(self.device) as mem:
            error, wire = run_pipeline(buckets, self._start, load, overlap=self.overlap,
                                       abort=self.engine.abort_weight_update)
        try:
            seconds, peak, wire, *more = conclude(self.engine, error, [time.perf_counter() - start, mem.extra_mb,
                                                                       float(wire), *extra],
                                                  self.g.everyone, self.device)
        except WeightSyncError as err:
            if self.keep_previous and self._restore():
                raise WeightSyncError(f"{err}; this engine reloaded its previous weights and generates "
                                      "on them") from None
            raise
        if self.keep_previous:
            self.previous = kept
        out = metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(buckets), peak, wire)
        return out if not more else _delta_metrics(out, *more)


# -- build (registered in transports/distributed.py) ---------------------------------------------------
def build_sender(p: BuildParts) -> DisaggregatedSender:
    source = ShardSource.from_actor(p.actor)
    # The engine side builds the same plan: tell it the dtype and head kind of the shards.
    p.sync_groups.everyone.broadcast_object({"dtype": source.dtype, "head": source.head}, src=0)
    ce = p.cfg.rollout.checkpoint_engine
    dtype = rollout_dtype(p.cfg.rollout.dtype, p.device)
    delta = delta_options(ce, dtype, "distributed")
    sender = DisaggregatedSender(source, p.sync_groups, int(ce.bucket_size_mb * 2**20),
                                 dtype=dtype if delta else None, delta=delta)
    if delta:
        p.say(f"megarl: delta weight sync on; this trainer rank keeps its last-sent shards in {ce.delta_copy} "
              f"memory: {sender.delta_copy_bytes() / 2**20:.1f} MiB")
    return sender


def build_receiver(p: BuildParts) -> DisaggregatedReceiver:
    info = p.sync_groups.everyone.broadcast_object(None, src=0)
    spec = HFCheckpoint(p.cfg.model.path).spec()
    ce = p.cfg.rollout.checkpoint_engine
    engine_dtype = getattr(p.engine, "dtype", None) or rollout_dtype(p.cfg.rollout.dtype, p.device)
    delta = delta_options(ce, engine_dtype, "distributed")
    return DisaggregatedReceiver(p.engine, spec, p.sync_groups, engine_dtype if delta else info["dtype"],
                                 int(ce.bucket_size_mb * 2**20), head=info["head"], device=p.device,
                                 overlap=ce.overlap, keep_previous=ce.keep_previous_weights is not False, delta=delta)


def build_distributed(p: BuildParts) -> DisaggregatedSender | DisaggregatedReceiver:
    """This rank's half of the distributed sync (registered in transports/distributed.py)."""
    if p.side == "trainer":
        return build_sender(p)
    if p.side == "rollout":
        return build_receiver(p)
    raise ValueError(f"the distributed transport is built by a trainer or a rollout rank, not a {p.side} one")
