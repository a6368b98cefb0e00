"""Process groups that span the two sides of a disaggregated job.

    store, rank, world = job_store(timeout_s)                       # the job's rendezvous store
    everyone = Bridge(store, "world", range(world), rank)           # built by its members only
    everyone.broadcast_object(obj, src=0); everyone.barrier()
    sync = Bridge(store, "sync/0.0", [0, 2, 3], rank, device=cuda)  # NCCL on GPUs, gloo on CPU
    work = sync.broadcast(bucket, src=0, async_op=True)

Under rollout.placement=disaggregated each side is a torch.distributed job of its own (its
default group holds its own ranks, so megatron's parallel_state spans the trainer ranks only).
What crosses between the sides goes over a Bridge: a gloo or NCCL backend built directly on a
prefix of the job's store by the ranks that belong to it, the way torchft builds its
cross-replica groups. Nothing is registered with torch's default group, so a `dist.*` call never
reaches across by accident; ranks given to a Bridge are the job's global ranks.
"""
from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megarl.parallel import loopback


def job_store(timeout_s: float):
    """(store, rank, world size) from the launcher's environment (torchrun, srun, tests): the store
    every rank of the job shares, before any process group exists. On one node without torchrun's
    agent store it listens on loopback only (parallel/loopback.py); torch's env:// store otherwise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = loopback.job_store(timeout)
    if store is not None:
        return store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return next(dist.rendezvous("env://", timeout=timeout))


class Bridge:
    def __init__(self, store, name: str, members: Iterable[int], global_rank: int,
                 device: torch.device | str = "cpu", timeout_s: float = 600.0):
        self.members = sorted(members)
        if global_rank not in self.members:
            raise ValueError(f"rank {global_rank} builds bridge {name!r} but is not one of its ranks {self.members}")
        self.name, self.device = name, torch.device(device)
        self.rank, self.size = self.members.index(global_rank), len(self.members)
        prefix = dist.PrefixStore(f"megarl/bridge/{name}", store)
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.size)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.size, datetime.timedelta(seconds=timeout_s))

    def group_rank(self, global_rank: int) -> int:
        return self.members.index(global_rank)

    # -- tensors (on self.device) ----------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = self.group_rank(src)
        work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([tensor], opts).wait()

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    # -- Python objects (pickled, over CPU tensors on a gloo bridge) ------------------------------
    def broadcast_object(self, obj, src: int):
        mine = self.members[self.rank] == src
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
        size = torch.tensor([data.numel() if mine else 0], dtype=torch.long, device=self.device)
        self.broadcast(size, src)
        buf = data.to(self.device) if mine else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self.broadcast(buf, src)
        return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_object(self, obj) -> list:
        """Every member's `obj`, in member order (a few small objects: one broadcast each)."""
        return [self.broadcast_object(obj if m == self.members[self.rank] else None, m) for m in self.members]
