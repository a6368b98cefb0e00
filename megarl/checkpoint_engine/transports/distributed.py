"""backend=distributed: the engine on ranks of its own (rollout.placement=disaggregated); each
side builds its half over the bridges megarl/trainer/ranks.py made
(megarl/checkpoint_engine/distributed.py)."""
from __future__ import annotations

from megarl.checkpoint_engine.config import register
from megarl.checkpoint_engine.delta_sync import delta_options
from megarl.checkpoint_engine.distributed import DisaggregatedReceiver, DisaggregatedSender
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.transport import BuildParts, Transport, WeightSync
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.rollout.native.engine import rollout_dtype


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


def build(p: BuildParts) -> WeightSync:
    if p.side == "trainer":
        return build_sender(p)
    if p.side == "rollout":
        return build_receiver(p)
    raise ValueError(f"the distributed transport is built by a trainer or a rollout rank, not a {p.side} one")


register(Transport(name="distributed", placements=("disaggregated",), delta=True, auto_for=("disaggregated",),
                   build=build))
