"""backend=distributed: the engine on ranks of its own (rollout.placement=disaggregated); each
side builds its half over the bridges megarl/job/ranks.py made
(megarl/checkpoint_engine/distributed.py)."""
from __future__ import annotations

from megarl.transports import Transport, register

register(Transport(name="distributed", placements=("disaggregated",), delta=True, auto_for=("disaggregated",),
                   build="megarl.checkpoint_engine.distributed:build_distributed"), module=__name__)
