"""Free space for a run's next checkpoint, checked before any process starts (megarl/launcher/preflight.py).

A full disk used to pass the preflight's write check (creating an empty file needs no blocks),
and the run then crashed at its first save. The need is the newest complete checkpoint in the run
directory when there is one, sized by the bytes its own manifest lists (the next save writes as
much beside it), else an estimate from the parameters the model's safetensors headers declare:
per trained role, a checkpoint holds the weights in the training dtype (2 bytes in bf16), the
optimizer's fp32 main copy (4, with a 16-bit model) and Adam's two fp32 moments (8), so at most
14 bytes a parameter (a 7B model: ~106 GB; the quickstart model saves 13.4 in fp32 on CPU, where
the weights are the main copy, with the metadata). A resume reads the step where it lies
(megarl/trainer/checkpoints/staging.py) and needs no space beyond it.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil

from safetensors import SafetensorError, safe_open

from megarl.config.errors import ConfigError

MANIFEST = "manifest.json"  # megarl.trainer.checkpoints.verified_io.MANIFEST (that module imports torch)

MARGIN = 2 << 20           # logs (the launcher reserves 1 MiB ahead of its log), metrics, the pointer
BYTES_PER_PARAM = 14       # bf16 weights + fp32 main copy + Adam's two fp32 moments, per trained role
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


def manifest_bytes(step_dir: str) -> int | None:
    """The bytes a step's manifest lists (its own file added), or None without a readable one."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        with open(path) as f:
            sizes = json.load(f).get("bytes")
        return sum(sizes.values()) + os.path.getsize(path)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def newest_checkpoint_bytes(run_dir: str) -> int | None:
    if not os.path.isdir(run_dir):
        return None
    steps = [(int(m.group(1)), m.group(0)) for m in map(_STEP.match, os.listdir(run_dir))
             if m and os.path.isfile(os.path.join(run_dir, m.group(0), "trainer_state.pt"))]
    if not steps:
        return None
    newest = os.path.join(run_dir, max(steps)[1])
    listed = manifest_bytes(newest)
    return listed if listed is not None else tree_bytes(newest)     # a step saved without a manifest


def parameter_count(model_dir: str | None) -> int:
    """The parameters the model's *.safetensors headers declare (no tensor is read); 0 for a model
    still to be bootstrapped or downloaded, or a header the weight check refuses anyway."""
    if not model_dir or not os.path.isdir(model_dir):
        return 0
    total = 0
    for name in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(model_dir, name), framework="numpy") as f:
                total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        except (OSError, SafetensorError):
            continue
    return total


def checkpoint_need(cfg) -> int:
    if cfg.trainer.save_freq <= 0:
        return MARGIN
    saved = newest_checkpoint_bytes(cfg.trainer.default_local_dir)
    if saved is not None:
        return saved + MARGIN
    roles = 1 + int(bool(cfg.critic.enable))
    return BYTES_PER_PARAM * parameter_count(cfg.model.path) * roles + MARGIN


def check_free_space(cfg, key: str = "trainer.default_local_dir") -> None:
    path = probe = os.path.abspath(cfg.trainer.default_local_dir)
    while not os.path.exists(probe):      # not made yet (--check makes nothing): the filesystem it goes on
        probe = os.path.dirname(probe)
    need, free = checkpoint_need(cfg), shutil.disk_usage(probe).free
    if free < need:
        raise ConfigError(f"{os.path.abspath(path)} has {free / 2**20:.1f} MiB free, but a checkpoint of this run "
                          f"needs about {need / 2**20:.1f} MiB; free space there or choose another directory", key)
