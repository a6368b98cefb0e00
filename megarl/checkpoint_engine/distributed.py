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

How a job uses it (rollout.placement=disaggregated, megarl/trainer/ranks.py): trainer ranks are
[0, N) with megatron's layout over them only, engine ranks [N, world); each side is a
torch.distributed job of its own, and only bridges reach across. The transport itself takes
any rank numbering through `trainer_rank(t, dp, p)`. With `keep_previous` the receiver holds the
last complete weights and reloads them when a sync fails (the engine keeps generating on them).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.checkpoint_engine.base import WeightSyncError, conclude, metrics
from megarl.checkpoint_engine.memory import PeakMemory
from megarl.checkpoint_engine.pipeline import Transfer, run_pipeline
from megarl.checkpoint_engine.plan import TransferPlan, build_plan
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.stream import bucket_stream, feed, takes_shards
from megarl.models.spec import ModelSpec
from megarl.parallel.bridge import Bridge
from megarl.rollout.base import RolloutEngine


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


def _check_same(plan: TransferPlan, dtype: torch.dtype, group) -> None:
    mine = f"{plan.digest()}/{dtype}"
    every = group.all_gather_object(mine)
    if len(set(every)) != 1:
        raise RuntimeError(f"trainer and engine ranks built different weight-sync plans ({sorted(set(every))}): "
                           "they must use the same model config, layout, bucket size and dtype")


class DisaggregatedSender:
    def __init__(self, source: ShardSource, groups: DisaggregatedGroups, bucket_bytes: int = 512 << 20):
        if source.vpp > 1:
            raise ValueError("the disaggregated sync plans stages without virtual-pipeline chunks; train with "
                             "virtual_pipeline_model_parallel_size=null or use the colocated sync")
        if (source.tp, source.pp) != (groups.tp, groups.pp):
            raise ValueError(f"groups were built for TP {groups.tp} x PP {groups.pp}, the shards are "
                             f"TP {source.tp} x PP {source.pp}")
        self.src, self.g = source, groups
        self.dtype, self.device = source.dtype, source.device
        self.plan = disaggregated_plan(source.spec, source.tp, source.pp, bucket_bytes, self.dtype, source.head)
        key = (source.tp_rank, source.pp_rank)
        self.sends = source.dp_rank == 0 and groups.senders[key] == groups.rank
        _check_same(self.plan, self.dtype, groups.everyone)

    def sync(self) -> dict[str, float]:
        with self.src.all_experts():      # MoE under EP: every expert, for this sync
            return self._sync()

    def _sync(self) -> dict[str, float]:
        src = self.src
        mine = [b for b in self.plan.buckets if self.sends and b.stage == src.pp_rank]
        start = time.perf_counter()
        with torch.no_grad(), PeakMemory(self.device) as mem:
            # Nothing to load here: each bucket's send is waited for once the next one is posted
            # (at most two buckets on the move).
            _, wire = run_pipeline(mine, self._start, lambda bucket, buf: None, overlap=True, abort=lambda: None)
        seconds, peak, wire = conclude(None, None, [time.perf_counter() - start, mem.extra_mb, float(wire)],
                                       self.g.everyone, self.device)
        return metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(self.plan.buckets), peak, wire)

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
                 overlap: bool = True, keep_previous: bool = False):
        self.engine, self.g, self.dtype, self.device, self.overlap = engine, groups, dtype, torch.device(device), overlap
        self.plan = disaggregated_plan(spec, groups.tp, groups.pp, bucket_bytes, dtype, head)
        self.want = takes_shards(engine)
        self.keep_previous = keep_previous
        self.previous: list[torch.Tensor] | None = None   # one buffer per bucket, host memory
        _check_same(self.plan, dtype, groups.everyone)

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
        works = [self.g.groups[(t, bucket.stage)].broadcast(buf[t * G:(t + 1) * G], src=self.g.senders[(t, bucket.stage)],
                                                            async_op=True) for t in range(self.g.tp)]
        return Transfer(buf, filling=works)

    def sync(self) -> dict[str, float]:
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
            seconds, peak, wire = conclude(self.engine, error, [time.perf_counter() - start, mem.extra_mb, float(wire)],
                                           self.g.everyone, self.device)
        except WeightSyncError as err:
            if self.keep_previous and self._restore():
                raise WeightSyncError(f"{err}; this engine reloaded its previous weights and generates on them") from None
            raise
        if self.keep_previous:
            self.previous = kept
        return metrics(seconds, self.plan.numel() * self.dtype.itemsize, len(buckets), peak, wire)
