"""Delta mode of the disk transport: an export holds only what changed since the previous one.

    sync = DiskSync(source, "/shared/run1/weights", delta=DeltaOptions(anchor_every=20, codec="zstd"))
    sync.sync()                                   # step_000001: full (anchor); step_000002..: deltas
    weights = read_weights("/shared/run1/weights")   # the engine's job: {HF name: tensor}, checksummed

An anchor is the transport's normal export (an HF checkpoint any loader reads). A delta export
holds `delta-0000k-of-0000N.safetensors` per bucket, one uint8 tensor per HF tensor (its frame:
indices + values, compressed XOR, or dense; delta.encode) with the encoding, element count and
checksum of the tensor's new value in the file's metadata, and `delta.json` naming the export it
applies to. read_weights follows `latest` back to the anchor, applies each delta in order and
checks every tensor's checksum, so a reader never gets a corrupt or partial chain silently.
Retention keeps every export the newest `keep` ones need (back to their anchor).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megarl.checkpoint_engine import delta as D
from megarl.config.dtypes import NAMES, canonical

DELTA_JSON = "delta.json"


def write_delta(path: str, tensors: dict[str, torch.Tensor], last: dict[str, torch.Tensor], dense_above: float,
                codec: str) -> tuple[int, int, int]:
    """One bucket's delta file; (bytes written, elements changed, elements)."""
    frames, meta, changed, total = {}, {}, 0, 0
    for name, new in tensors.items():
        flat = new.reshape(-1)
        f = D.encode(flat, last[name].reshape(-1), dense_above, codec)
        frames[name] = f.payload if f.payload.numel() else torch.zeros(0, dtype=torch.uint8)
        meta[name] = json.dumps([f.kind, f.codec, f.nnz, flat.numel(), str(new.dtype).removeprefix("torch."),
                                 list(new.shape), *D.checksum(new)])
        changed, total = changed + f.nnz, total + flat.numel()
    save_file(frames, path, metadata=meta)
    return sum(t.numel() for t in frames.values()), changed, total


def write_manifest(tmp: str, base: str, files: list[str]) -> None:
    with open(os.path.join(tmp, DELTA_JSON), "w") as f:
        json.dump({"base": base, "files": files}, f)


def base_of(export: str) -> str | None:
    """The export a delta export applies to; None for an anchor (a full HF export)."""
    try:
        with open(os.path.join(export, DELTA_JSON)) as f:
            return json.load(f)["base"]
    except FileNotFoundError:
        return None


def chain(disk_dir: str, name: str) -> list[str]:
    """`name` and the exports it needs, oldest (the anchor) first."""
    out = [name]
    while (base := base_of(os.path.join(disk_dir, out[-1]))) is not None:
        out.append(base)
    return out[::-1]


def needed(disk_dir: str, newest: list[str]) -> set[str]:
    return {n for name in newest for n in chain(disk_dir, name)}


def _read_full(export: str) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(os.listdir(export)):
        if fname.endswith(".safetensors"):
            out.update(load_file(os.path.join(export, fname)))
    return out


def _apply(export: str, weights: dict[str, torch.Tensor]) -> None:
    with open(os.path.join(export, DELTA_JSON)) as f:
        files = json.load(f)["files"]
    for fname in files:
        path = os.path.join(export, fname)
        with safe_open(path, "pt") as fh:
            meta = fh.metadata()
            for name in fh.keys():
                kind, codec, nnz, n, dtype, shape, s0, s1 = json.loads(meta[name])
                if canonical(dtype) != dtype:       # the exporter writes torch's names; anything else is damage
                    raise ValueError(f"{path}: {name} names dtype {dtype!r}; expected one of {NAMES}")
                dtype = getattr(torch, dtype)
                idx, vals = D.decode(kind, codec, fh.get_tensor(name), n, nnz, dtype)
                cur = weights[name].reshape(-1)
                if idx is None:
                    cur = vals.clone()
                else:
                    cur[idx] = D.updated(kind, cur[idx], vals, dtype)
                cur = cur.view(shape)
                if D.checksum(cur) != (s0, s1):
                    raise ValueError(f"{path}: {name} does not match its checksum after the delta; the export chain "
                                     "is corrupt (the next full export repairs it)")
                weights[name] = cur


def read_weights(disk_dir: str, name: str | None = None) -> dict[str, torch.Tensor]:
    """The weights of export `name` (default: what `latest` names), deltas applied and checked."""
    if name is None:
        with open(os.path.join(disk_dir, "latest")) as f:
            name = f.read().strip()
    steps = chain(disk_dir, name)
    weights = _read_full(os.path.join(disk_dir, steps[0]))
    for step in steps[1:]:
        _apply(os.path.join(disk_dir, step), weights)
    return weights
