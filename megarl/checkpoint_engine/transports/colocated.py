"""backend=colocated: the engine on the training ranks (megarl/checkpoint_engine/colocated.py)."""
from __future__ import annotations

import torch.distributed as dist

from megarl.checkpoint_engine.colocated import ColocatedSync
from megarl.checkpoint_engine.config import register
from megarl.checkpoint_engine.delta_sync import delta_options
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.transport import BuildParts, Transport
from megarl.config.errors import ConfigError


def build(p: BuildParts) -> ColocatedSync:
    ce, ro = p.cfg.rollout.checkpoint_engine, p.cfg.rollout
    source = ShardSource.from_actor(p.actor)
    delta_options(ce, source.dtype, "colocated")          # delta=auto: says in the log that it is off here
    if p.engine is None:
        raise ValueError("backend=colocated needs the rollout engine of this rank (build_rollout(...))")
    if p.rollout_group is not None and dist.get_world_size(p.rollout_group) != ro.tensor_model_parallel_size:
        raise ConfigError(f"the rollout group has {dist.get_world_size(p.rollout_group)} ranks, the config says "
                          f"{ro.tensor_model_parallel_size}", "actor_rollout_ref.rollout.tensor_model_parallel_size")
    return ColocatedSync(source, p.engine, int(ce.bucket_size_mb * 2**20), overlap=ce.overlap)


# Deltas pay over a link; colocated shards move between the ranks of one job, so none are sent.
register(Transport(name="colocated", placements=("colocated",), delta=False, auto_for=("colocated",), build=build))
