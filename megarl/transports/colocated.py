"""backend=colocated: the engine on the training ranks (megarl/checkpoint_engine/colocated.py)."""
from __future__ import annotations

from megarl.transports import Transport, register

# Deltas pay over a link; colocated shards move between the ranks of one job, so none are sent.
register(Transport(name="colocated", placements=("colocated",), delta=False, auto_for=("colocated",),
                   build="megarl.checkpoint_engine.colocated:build_colocated"), module=__name__)
