"""Disk transport: the actor's weights as an HF checkpoint, for a rollout engine in another job.

    sync = DiskSync(ShardSource.from_actor(actor), "/shared/run1/weights", bucket_bytes=512 << 20)
    metrics = sync.sync()                          # every training rank; writes .../step_000001/
    path = latest_export("/shared/run1/weights")   # the engine's job: the newest complete export
    NativeEngine.from_pretrained(path)             # or AutoModelForCausalLM.from_pretrained(path)

One export is what transformers' save_pretrained writes: config.json, one
model-0000k-of-0000N.safetensors per bucket, model.safetensors.index.json (weight_map,
total_size) and the tokenizer files of the actor's HF directory. Each pipeline stage's TP group
(DP replica 0) all-gathers its buckets and its TP rank 0 writes them, so stages write in parallel.

Atomic: files go to a hidden temporary directory, which rank 0 renames to step_NNNNNN (a
rename is atomic within one filesystem) and only then points `latest` (a one-line file, swapped
with os.replace) at it. A reader that follows `latest` never sees a partial export. Exports
beyond the newest `keep` are deleted. `disk_dir` must be one filesystem every writer sees
(shared storage across nodes).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.checkpoint_engine.base import WeightSyncError, agree, conclude, metrics
from megarl.checkpoint_engine.colocated import gather_in_place
from megarl.checkpoint_engine.memory import PeakMemory
from megarl.checkpoint_engine.plan import build_plan
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.stream import bucket_stream
from megarl.models.convert import hf_names
from megarl.models.hf_checkpoint import AUX_FILES

_STEP = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"


def latest_export(disk_dir: str) -> str | None:
    """The newest complete export in `disk_dir` (what `latest` names), or None before the first."""
    try:
        with open(os.path.join(disk_dir, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(disk_dir, name)
    return path if os.path.isdir(path) else None


def _exports(disk_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(disk_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(disk_dir) if (m := _STEP.match(n))]
    return sorted(found)


class DiskSync:
    def __init__(self, source: ShardSource, disk_dir: str, bucket_bytes: int = 512 << 20, keep: int = 2,
                 aux_from: str | None = None, group=None):
        self.src, self.dir, self.keep, self.aux_from, self.group = source, os.path.abspath(disk_dir), keep, aux_from, group
        self.dtype, self.device = source.dtype, source.device
        self.out_dtype = source.hf_dtype or self.dtype
        self.plan = build_plan(source.spec, source.tp, source.pp, bucket_bytes, self.dtype.itemsize, (), source.head,
                               vpp=source.vpp)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # Numbering continues after the exports already there (a resumed run); rank 0 decides.
        last = [_exports(self.dir)[-1][0] if self.rank == 0 and _exports(self.dir) else 0]
        if dist.is_initialized():
            dist.broadcast_object_list(last, src=0, group=group)
        self.version = last[0]
        self.last_path: str | None = None

    def _file(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{len(self.plan.buckets):05d}.safetensors"

    def _write_stage(self, tmp: str) -> int:
        """Gather this stage's buckets (DP replica 0) and write them on TP rank 0; bytes written."""
        src, T, written = self.src, self.src.tp, 0
        if src.dp_rank != 0:
            return 0
        for k, bucket in enumerate(self.plan.buckets):
            if bucket.stage != src.pp_rank:
                continue
            G = bucket.gather_numel
            buf = torch.empty(T * G, dtype=self.dtype, device=self.device)
            slot = buf[src.tp_rank * G:(src.tp_rank + 1) * G]
            for e in bucket.entries:
                if e.gather:
                    slot[e.offset:e.offset + e.numel].copy_(src.params[e.name].reshape(-1))
            if G and T > 1:
                for work in gather_in_place(buf, src.tp_rank, T, src.tp_group):
                    work.wait()
            if src.tp_rank == 0:
                tensors = {n: t.to("cpu", self.out_dtype).contiguous()
                           for n, t in bucket_stream(self.plan, bucket, buf, src.tp_rank, src.params)}
                save_file(tensors, os.path.join(tmp, self._file(k)), metadata={"format": "pt"})
                written += sum(t.numel() * t.element_size() for t in tensors.values())
            del buf
        return written

    def _publish(self, tmp: str, name: str) -> None:
        """Rank 0: index, config and tokenizer into the temp dir, rename it, point `latest` at it."""
        spec = self.src.spec
        weight_map = {h: self._file(k) for k, b in enumerate(self.plan.buckets)
                      for e in b.entries for h in hf_names(e.name, spec, self.src.head)}
        total = self.plan.numel() * self.out_dtype.itemsize
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = dict(spec.hf_config)
        config["dtype"] = str(self.out_dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for aux in AUX_FILES if self.aux_from else ():
            path = os.path.join(self.aux_from, aux)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(tmp, aux))
        final = os.path.join(self.dir, name)
        os.rename(tmp, final)
        pointer = os.path.join(self.dir, f".{LATEST}.tmp")
        with open(pointer, "w") as f:
            f.write(name + "\n")
        os.replace(pointer, os.path.join(self.dir, LATEST))
        for _, old in _exports(self.dir)[:-self.keep]:
            shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)

    def sync(self) -> dict[str, float]:
        with self.src.all_experts():      # MoE under EP: every expert, for this sync
            return self._sync()

    def _sync(self) -> dict[str, float]:
        """Collective over the training ranks; returns metrics, raises WeightSyncError on failure."""
        self.version += 1
        name = f"step_{self.version:06d}"
        tmp = os.path.join(self.dir, f".tmp-{name}")
        start, mem = time.perf_counter(), PeakMemory(self.device)
        error, written = None, 0
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)        # left over from a crashed run
                os.makedirs(tmp)
            except OSError as err:
                error = err
        if not agree(error is not None, [], self.group, self.device)[0]:   # the temp dir exists for all
            with torch.no_grad(), mem:
                try:
                    written = self._write_stage(tmp)
                except Exception as err:  # noqa: BLE001 - reported on every rank by conclude()
                    error = err
        try:
            peak, wire = conclude(None, error, [mem.extra_mb, float(written)], self.group, self.device)
            error = None
            if self.rank == 0:
                try:
                    self._publish(tmp, name)
                except OSError as err:
                    error = err
            conclude(None, error, [], self.group, self.device)
        except WeightSyncError:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last_path = os.path.join(self.dir, name)
        seconds = time.perf_counter() - start
        return metrics(seconds, self.plan.numel() * self.out_dtype.itemsize, len(self.plan.buckets), peak, wire)
