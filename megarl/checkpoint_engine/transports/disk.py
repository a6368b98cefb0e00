"""backend=disk: HF checkpoints in disk_dir for an engine in another job
(megarl/checkpoint_engine/disk.py)."""
from __future__ import annotations

from megarl.checkpoint_engine.config import KEY, register
from megarl.checkpoint_engine.delta_sync import delta_options
from megarl.checkpoint_engine.disk import DiskSync
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.transport import BuildParts, Transport
from megarl.config.errors import ConfigError


def check_disk_dir(cfg) -> None:
    if not cfg.rollout.checkpoint_engine.disk_dir:
        raise ConfigError("backend=disk needs disk_dir=<a directory the engine's job can read>", f"{KEY}.disk_dir")


def build(p: BuildParts) -> DiskSync:
    ce = p.cfg.rollout.checkpoint_engine
    source = ShardSource.from_actor(p.actor)
    delta = delta_options(ce, source.hf_dtype or source.dtype, "disk")   # the export's dtype
    return DiskSync(source, ce.disk_dir, int(ce.bucket_size_mb * 2**20), keep=ce.disk_keep, aux_from=p.cfg.model.path,
                    delta=delta)


# Placement colocated: the trainer's own loop runs there, and what reads the exports is an engine
# outside this job, not ranks of this one.
register(Transport(name="disk", placements=("colocated",), delta=True, checks=(check_disk_dir,), build=build))
