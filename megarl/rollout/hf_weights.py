"""HF checkpoints as the same (name, tensor) bucket stream the trainer's weight sync produces.

    for bucket in buckets(iter_hf_weights(model_dir), bucket_bytes=512 << 20):
        engine.update_weights(bucket)
    engine.finalize_weights()

Reading tensor by tensor (safetensors' lazy `safe_open`) keeps at most one bucket in memory.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for path in bins:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into lists of about `bucket_bytes` (a tensor is never split)."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
