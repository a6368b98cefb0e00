"""Free space for a run's next checkpoint, checked before any process starts (megarl/launcher/preflight.py).

A full disk used to pass the preflight's write check (creating an empty file needs no blocks),
and the run then crashed at its first save. The need is the newest complete checkpoint in the run
directory when there is one (the next save writes as much beside it), else an estimate from the
model's weight files: a checkpoint holds fp32 weights and Adam's two moments, about 3.3x a bf16
safetensors file of the same model (measured on the quickstart model: 5.2 MB for 1.6 MB), per
trained role.
"""
from __future__ import annotations

import os
import re
import shutil

from megarl.config.errors import ConfigError

MARGIN = 2 << 20           # logs (the launcher reserves 1 MiB ahead of its log), metrics, the pointer
WEIGHT_FACTOR = 4          # checkpoint bytes per byte of the model's weight files (rounded up from 3.3)
_STEP = re.compile(r"^global_step_(\d+)$")


def tree_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def newest_checkpoint_bytes(run_dir: str) -> int | None:
    if not os.path.isdir(run_dir):
        return None
    steps = [(int(m.group(1)), m.group(0)) for m in map(_STEP.match, os.listdir(run_dir))
             if m and os.path.isfile(os.path.join(run_dir, m.group(0), "trainer_state.pt"))]
    return tree_bytes(os.path.join(run_dir, max(steps)[1])) if steps else None


def weight_bytes(model_dir: str | None) -> int:
    if not model_dir or not os.path.isdir(model_dir):
        return 0       # bootstrapped or downloaded later: nothing to measure yet
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith((".safetensors", ".bin", ".pt")))


def checkpoint_need(cfg) -> int:
    if cfg.trainer.save_freq <= 0:
        return MARGIN
    saved = newest_checkpoint_bytes(cfg.trainer.default_local_dir)
    if saved is not None:
        return saved + MARGIN
    roles = 1 + int(bool(cfg.critic.enable))
    return WEIGHT_FACTOR * weight_bytes(cfg.model.path) * roles + MARGIN


def check_free_space(cfg, key: str = "trainer.default_local_dir") -> None:
    path = probe = os.path.abspath(cfg.trainer.default_local_dir)
    while not os.path.exists(probe):      # not made yet (--check makes nothing): the filesystem it goes on
        probe = os.path.dirname(probe)
    need, free = checkpoint_need(cfg), shutil.disk_usage(probe).free
    if free < need:
        raise ConfigError(f"{os.path.abspath(path)} has {free / 2**20:.1f} MiB free, but a checkpoint of this run "
                          f"needs about {need / 2**20:.1f} MiB; free space there or choose another directory", key)
