"""backend=disk: HF checkpoints in disk_dir for an engine in another job
(megarl/checkpoint_engine/disk.py)."""
from __future__ import annotations

from megarl.transports import KEY, Transport, register
from megarl.config.errors import ConfigError


def check_disk_dir(cfg) -> None:
    if not cfg.rollout.checkpoint_engine.disk_dir:
        raise ConfigError("backend=disk needs disk_dir=<a directory the engine's job can read>", f"{KEY}.disk_dir")


# Placement colocated: the trainer's own loop runs there, and what reads the exports is an engine
# outside this job, not ranks of this one.
register(Transport(name="disk", placements=("colocated",), delta=True, checks=(check_disk_dir,),
                   build="megarl.checkpoint_engine.disk:build_disk"), module=__name__)
