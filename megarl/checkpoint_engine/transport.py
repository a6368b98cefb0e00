"""What a transport is to the trainer: the calls it makes (WeightSync) and what a build gets
(BuildParts); the registered entry (Transport) is declared in megarl/transports. Loads no torch,
so the package imports light.

The trainer calls only what WeightSync declares, on every transport; one that has nothing to do
for a call implements it as a no-op that says why (e.g. request_anchor where every sync is full).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:       # annotations only
    import torch
    import torch.distributed as dist

    from megarl.rollout.base import RolloutEngine
    from megarl.workers.actor import ActorWorker


class WeightSync(Protocol):
    """One rank's side of a transport (colocated, disk, or one half of the distributed one)."""

    def sync(self) -> dict[str, float]:
        """Collective over the transport's ranks: move the current weights; metrics (weight_sync/*).
        Raises WeightSyncError on every rank if any rank failed."""
        ...

    def request_anchor(self, why: str) -> None:
        """Make the next sync a full one (delta syncs; called after the trainer resumed, since the
        engine's weights no longer match the last-sent copy). `why` goes to the log."""
        ...


Side = Literal["colocated", "trainer", "rollout"]     # Ranks.role: which half of the sync this rank runs


@dataclass
class BuildParts:
    """What a transport's build gets on one rank; the fields a side does not have are None."""
    cfg: Any                # the run's ExperimentConfig (megarl/experiment.py composes this package)
    side: Side
    actor: ActorWorker | None = None             # the megatron shards (training ranks)
    engine: RolloutEngine | None = None          # this rank's rollout engine (ranks that host one)
    rollout_group: dist.ProcessGroup | None = None   # this rank's rollout-TP group (None at rollout TP 1)
    # placement=disaggregated: the bridges across sides, a checkpoint_engine.distributed.DisaggregatedGroups
    # (not named in the annotation: that module builds on this one)
    sync_groups: Any = None
    device: torch.device | None = None
    say: Callable[[str], None] = print           # one line to the run's log
