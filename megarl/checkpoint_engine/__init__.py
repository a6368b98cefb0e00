"""Weight sync from the actor's megatron (TP, PP) shards to the rollout engine.

    engine_sync = build_checkpoint_engine(cfg, actor, rollout, rollout_group=ranks.rollout_group)
    metrics = engine_sync.sync()      # collective: every rank, after each policy update

Transports (`actor_rollout_ref.rollout.checkpoint_engine.backend`):
    colocated    engine on the training ranks (default): TP all-gather + PP broadcast in buckets
                 (colocated.py)
    distributed  engine on ranks of its own: the trainer's TP ranks broadcast buckets to the
                 engine's ranks over groups spanning both (distributed.py; placement=disaggregated,
                 built by megarl/trainer/disaggregated.py)
    disk         HF safetensors + index in disk_dir/step_NNNNNN, written atomically (disk.py)
`checkpoint_engine.delta` (off/on/auto): the distributed and disk transports send only the
elements that changed, with full anchors (delta_sync.py, disk_delta.py; docs/weight-sync.md).
The plan (plan.py) is computed once per engine_sync; metrics are
{"weight_sync/seconds", "weight_sync/gb", "weight_sync/gb_per_s", "weight_sync/buckets",
 "weight_sync/peak_extra_mb", "weight_sync/wire_gb"}, each the largest over ranks.
"""
from __future__ import annotations

import torch.distributed as dist

from megarl.checkpoint_engine.base import WeightSyncError
from megarl.checkpoint_engine.colocated import ColocatedSync
from megarl.checkpoint_engine.delta_sync import delta_options
from megarl.checkpoint_engine.disk import DiskSync
from megarl.checkpoint_engine.source import ShardSource
from megarl.config.errors import ConfigError

__all__ = ["WeightSyncError", "build_checkpoint_engine"]

_KEY = "actor_rollout_ref.rollout.checkpoint_engine"


def build_checkpoint_engine(cfg, actor, rollout=None, rollout_group=None):
    """The weight sync for this experiment. `rollout_group`: this rank's rollout-TP group (None at
    rollout TP 1), checked against the config. Every rank calls this (it agrees on a plan)."""
    ce, ro = cfg.rollout.checkpoint_engine, cfg.rollout
    backend = ce.backend
    if backend == "auto":
        backend = "colocated" if ro.placement == "colocated" else "distributed"
    if backend == "distributed":
        raise ConfigError("the distributed transport needs the engine on ranks of its own: set "
                          "actor_rollout_ref.rollout.placement=disaggregated (the trainer then builds it, "
                          "megarl/trainer/disaggregated.py), or use backend=colocated or disk", f"{_KEY}.backend")
    source = ShardSource.from_actor(actor)
    bucket_bytes = int(ce.bucket_size_mb * 2**20)
    if backend == "disk":
        delta = delta_options(ce, source.hf_dtype or source.dtype, "disk")   # the export's dtype
        return DiskSync(source, ce.disk_dir, bucket_bytes, keep=ce.disk_keep, aux_from=cfg.model.path, delta=delta)
    delta_options(ce, source.dtype, "colocated")          # delta=auto: says in the log that it is off here
    if rollout is None:
        raise ValueError("backend=colocated needs the rollout engine of this rank (build_rollout(...))")
    if rollout_group is not None:
        if dist.get_world_size(rollout_group) != ro.tensor_model_parallel_size:
            raise ConfigError(f"the rollout group has {dist.get_world_size(rollout_group)} ranks, the config says "
                              f"{ro.tensor_model_parallel_size}", "actor_rollout_ref.rollout.tensor_model_parallel_size")
    return ColocatedSync(source, rollout, bucket_bytes, overlap=ce.overlap)
