"""Configuration of the weight sync (`actor_rollout_ref.rollout.checkpoint_engine.*`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.typed import Section, require


@dataclass
class CheckpointEngineConfig(Section):
    # colocated: the engine shares the training ranks (all-gather + broadcast in buckets);
    # distributed: the engine has ranks of its own, buckets cross a group spanning both;
    # disk: HF safetensors written to `disk_dir` for an engine in another job.
    backend: Literal["auto", "colocated", "distributed", "disk"] = "auto"  # auto: from rollout.placement
    bucket_size_mb: float = 512            # one bucket's buffer (MiB); a rank holds at most two, plus one tensor
    overlap: bool = True                   # move the next bucket while the engine loads this one
    disk_dir: str | None = None            # backend=disk: where step_NNNNNN/ exports and `latest` go
    disk_keep: int = 2                     # backend=disk: newest exports kept (older ones are deleted)
    update_weights_bucket_megabytes: float | None = None  # verl's name for bucket_size_mb
    # distributed only (null: true there): engine ranks keep the last complete weights in host
    # memory (one model copy per engine rank) and reload them when a sync fails, so the engine goes
    # on generating on its old weights. false: an in-place engine (native, hf) refuses to generate
    # until a sync succeeds.
    keep_previous_weights: bool | None = None

    def __post_init__(self):
        if self.update_weights_bucket_megabytes is not None:
            self.bucket_size_mb = self.update_weights_bucket_megabytes
        require(self.bucket_size_mb > 0, "bucket_size_mb", "must be > 0 (MiB)")
        require(self.backend != "disk" or bool(self.disk_dir), "disk_dir",
                "backend=disk needs disk_dir=<a directory the engine's job can read>")
        require(self.disk_keep >= 1, "disk_keep", "must be >= 1 (the newest export is always kept)")
