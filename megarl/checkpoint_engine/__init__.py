"""Weight sync from the actor's megatron (TP, PP) shards to the rollout engine.

    engine_sync = build_checkpoint_engine(cfg, actor, rollout, rollout_group=ranks.rollout_group)
    metrics = engine_sync.sync()      # collective: every rank, after each policy update

Transports (`actor_rollout_ref.rollout.checkpoint_engine.backend`), one declaration module each
in megarl/transports/ (which is the registry; docs/weight-sync.md, "Adding a transport"):
    colocated    engine on the training ranks (default): TP all-gather + PP broadcast in buckets
                 (colocated.py)
    distributed  engine on ranks of its own: the trainer's TP ranks broadcast buckets to the
                 engine's ranks over groups spanning both (distributed.py; placement=disaggregated,
                 where each side builds its half: side="trainer" or "rollout")
    disk         HF safetensors + index in disk_dir/step_NNNNNN, written atomically (disk.py)
`checkpoint_engine.delta` (off/on/auto): the distributed and disk transports send only the
elements that changed, with full anchors (delta_sync.py, disk_delta.py; docs/weight-sync.md).
The plan (plan.py) is computed once per engine_sync; metrics are
{"weight_sync/seconds", "weight_sync/gb", "weight_sync/gb_per_s", "weight_sync/buckets",
 "weight_sync/peak_extra_mb", "weight_sync/wire_gb"}, each the largest over ranks.

This module loads no torch (the registry and the contract are light); a transport's module
loads it when that transport is built.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megarl.checkpoint_engine.errors import WeightSyncError
from megarl.checkpoint_engine.transport import BuildParts, Side, WeightSync
from megarl.config.errors import ConfigError
from megarl.transports import KEY, Transport, chosen, placement_problem

if TYPE_CHECKING:       # annotations only
    import torch
    import torch.distributed as dist

    from megarl.checkpoint_engine.distributed import DisaggregatedGroups
    from megarl.rollout.base import RolloutEngine
    from megarl.workers.actor import ActorWorker

__all__ = ["WeightSync", "WeightSyncError", "build_checkpoint_engine"]


def build_checkpoint_engine(cfg, actor: ActorWorker | None = None, rollout: RolloutEngine | None = None,
                            rollout_group: dist.ProcessGroup | None = None, *, side: Side = "colocated",
                            sync_groups: DisaggregatedGroups | None = None, device: torch.device | None = None,
                            say: Callable[[str], None] = print) -> WeightSync:
    """This rank's side of the transport the config names (backend=auto: the placement's default).
    `rollout_group`: this rank's rollout-TP group (None at rollout TP 1), checked against the
    config; `side`, `sync_groups`, `device`: Ranks.role and the bridges of a disaggregated run.
    Every rank calls this (the ranks agree on a plan)."""
    entry = chosen(cfg.rollout.checkpoint_engine.backend, cfg.rollout.placement)
    problem = placement_problem(entry, cfg.rollout.placement)
    if problem:
        raise ConfigError(problem, f"{KEY}.backend")
    if not isinstance(entry, Transport):
        raise TypeError(f"transport {entry.name!r} was registered without a build; register a "
                        "megarl.transports.Transport")
    return entry.builder()(BuildParts(cfg, side, actor=actor, engine=rollout, rollout_group=rollout_group,
                                  sync_groups=sync_groups, device=device, say=say))
