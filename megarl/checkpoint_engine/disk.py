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

from megarl.checkpoint_engine.base import agree, conclude, metrics
from megarl.checkpoint_engine.colocated import gather_in_place
from megarl.checkpoint_engine.delta_sync import DeltaOptions, delta_options
from megarl.checkpoint_engine.disk_delta import needed, write_delta, write_manifest
from megarl.checkpoint_engine.errors import WeightSyncError
from megarl.checkpoint_engine.memory import PeakMemory
from megarl.checkpoint_engine.plan import build_plan
from megarl.checkpoint_engine.source import ShardSource
from megarl.checkpoint_engine.stream import bucket_stream
from megarl.checkpoint_engine.transport import BuildParts
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
                 aux_from: str | None = None, group=None, delta: DeltaOptions | None = None):
        self.src, self.dir, self.keep, self.aux_from, self.group = (source, os.path.abspath(disk_dir), keep, aux_from,
                                                                    group)
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
        # Delta mode (disk_delta.py): the writers' last-written tensors per bucket (host memory),
        # why the next export must be full, and the syncs since the last full one.
        self.delta, self.written, self.reason, self.since = delta, {}, "first sync", 0
        self.anchor, self.changed = True, [0, 0]

    def request_anchor(self, why: str) -> None:
        """Make the next export full (delta mode), e.g. after the trainer resumed from a checkpoint."""
        self.reason = self.reason or why

    def delta_copy_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.written.values() for t in d.values())

    def _delta_file(self, k: int) -> str:
        return f"delta-{k + 1:05d}-of-{len(self.plan.buckets):05d}.safetensors"

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
                if self.delta is not None and not self.anchor:
                    size, changed, total = write_delta(os.path.join(tmp, self._delta_file(k)), tensors, self.written[k],
                                                       self.delta.dense_above, self.delta.codec)
                    written += size
                    self.changed = [self.changed[0] + changed, self.changed[1] + total]
                else:
                    save_file(tensors, os.path.join(tmp, self._file(k)), metadata={"format": "pt"})
                    written += sum(t.numel() * t.element_size() for t in tensors.values())
                if self.delta is not None:      # a copy: .to() may return the live parameter itself
                    self.written[k] = {n: t.clone() for n, t in tensors.items()}
            del buf
        return written

    def _publish(self, tmp: str, name: str) -> None:
        """Rank 0: index, config and tokenizer into the temp dir, rename it, point `latest` at it."""
        spec = self.src.spec
        if self.delta is not None and not self.anchor:
            write_manifest(tmp, os.path.basename(self.last_path),
                           [self._delta_file(k) for k in range(len(self.plan.buckets))])
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
        every = [n for _, n in _exports(self.dir)]
        keep = needed(self.dir, every[-self.keep:]) if self.delta is not None else set(every[-self.keep:])
        for old in every:
            if old not in keep:
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
        if self.delta is not None:
            self._decide()
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
            self.reason = "the previous export failed"
            raise
        self.last_path = os.path.join(self.dir, name)
        seconds = time.perf_counter() - start
        out = metrics(seconds, self.plan.numel() * self.out_dtype.itemsize, len(self.plan.buckets), peak, wire)
        if self.delta is not None:
            self.reason, self.since = None, 0 if self.anchor else self.since + 1
            out.update({"weight_sync/anchor": float(self.anchor),
                        "weight_sync/changed_frac": 1.0 if self.anchor else self.changed[0] / max(self.changed[1], 1),
                        "weight_sync/delta_copy_mb": self.delta_copy_bytes() / 2**20})
        return out

    def _decide(self) -> None:
        """Full export or delta: rank 0's call, shared with every writer."""
        why = self.reason or (f"every {self.delta.anchor_every} exports"
                              if self.since + 1 >= self.delta.anchor_every else None)
        if self.last_path is None or not os.path.isdir(self.last_path):
            why = why or "no previous export to apply to"
        got = [why]
        if dist.is_initialized():
            dist.broadcast_object_list(got, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                                       group=self.group)
        self.anchor, self.changed = got[0] is not None, [0, 0]


def build_disk(p: BuildParts) -> DiskSync:
    """This rank's disk export (registered in transports/disk.py)."""
    ce = p.cfg.rollout.checkpoint_engine
    source = ShardSource.from_actor(p.actor)
    delta = delta_options(ce, source.hf_dtype or source.dtype, "disk")   # the export's dtype
    return DiskSync(source, ce.disk_dir, int(ce.bucket_size_mb * 2**20), keep=ce.disk_keep, aux_from=p.cfg.model.path,
                    delta=delta)
