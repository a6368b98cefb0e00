"""The rollout TP group around TensorRT-LLM (rank 0 owns the LLM; the others gather and wait) and
the weight buckets' CUDA-IPC handles in the format of TensorRT-LLM's worker extension.

The followers wait for the leader's result through the leader's whole engine start-up and every
generate() (minutes to hours on long rollouts). A collective on the launcher's group would give up
after that group's timeout (600 s for NCCL by default) and kill the TP >= 2 group, so that one
wait runs on a gloo group of its own whose timeout is sized for rollouts (`wait_timeout_s`). It
is made with use_local_synchronization, so only the TP group's ranks take part in making it
(other TP groups build their engines at the same time, with other ranks)."""
from __future__ import annotations

import base64
import glob
import json
import os
import pickle
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.multiprocessing.reductions import reduce_tensor


def bucket_handles(named: Iterable[tuple[str, torch.Tensor]], device_uuid: str) -> dict[str, str]:
    """{device UUID: base64 of pickled [(HF name, torch IPC handle)]}, the worker extension's format."""
    handles = [(name, reduce_tensor(t.detach().contiguous())) for name, t in named]
    return {device_uuid: base64.b64encode(pickle.dumps(handles)).decode("ascii")}


def checkpoint_names(model_dir: str) -> list[str]:
    """Tensor names of an HF checkpoint (what a full sync must deliver), from safetensors headers."""
    names: list[str] = []
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return [n for n in names if not n.endswith("rotary_emb.inv_freq")]


def vocab_size(model_dir: str) -> int | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("vocab_size")
    except OSError:
        return None


WAIT_TIMEOUT_S = 24 * 3600.0   # how long followers wait for the leader's start-up or one generate()


class Group:
    """Rank and size in the rollout TP group (one rank without a group). `broadcast` is the
    followers' wait for the leader and runs on a gloo group with `wait_timeout_s`."""

    def __init__(self, group, wait_timeout_s: float = WAIT_TIMEOUT_S):
        self.group = group
        self.wait_group = None
        if group is None or not dist.is_initialized():
            self.rank, self.size = 0, 1
            return
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.size > 1:
            self.wait_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                             timeout=timedelta(seconds=wait_timeout_s),
                                             use_local_synchronization=True)

    def leader(self) -> int:
        return dist.get_global_rank(self.group, 0)

    def gather(self, obj):
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.leader(), group=self.group)
        return out

    def all_gather(self, obj):
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader(), group=self.wait_group)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
