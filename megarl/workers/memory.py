"""Memory: which device tensors a role holds (weights, grad buffers, optimizer state) and moving
them to host memory and back. Part of MegatronEngine (megarl/workers/engine.py); the role's
offload plan is megarl/workers/offload.py.

    mem = Memory(shards, chunks, optimizer)
    moved = mem.offload(params=True, grads=True, optimizer=True)    # bytes; storages freed on the device
    mem.onload()                                                    # bit-exact; grad buffers come back zeroed
"""
from __future__ import annotations

import torch

from megarl.parallel import cpu_compat
from megarl.workers.offload import HostStash, resident_bytes
from megarl.workers.optim import CPUAdamW, _megatron_parts


class Memory(cpu_compat.Boundary):
    def __init__(self, shards, chunks: list, optimizer, trainable: bool):
        self.shards, self.chunks, self.optimizer = shards, chunks, optimizer
        self.device, self.trainable = shards.device, trainable
        self.stash = HostStash()
        self.offloaded = False

    def param_tensors(self) -> list[torch.Tensor]:
        # DDP's flat param buffers (distributed optimizer) share storage with the params: one copy moves
        return list(self.shards.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        if not self.trainable:
            return []
        return [b.grad_data for c in self.chunks for b in c.buffers + c.expert_parallel_buffers
                if b.grad_data is not None]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Adam moments and (mixed precision) fp32 master weights; with fp32 weights the masters
        are the weights themselves, so they move with the optimizer."""
        if self.optimizer is None:
            return []
        parts = [self.optimizer.optimizer] if isinstance(self.optimizer, CPUAdamW) else \
            [getattr(o, "optimizer", None) for o in _megatron_parts(self.optimizer)]
        out = []
        for opt in filter(None, parts):
            out += [p for g in opt.param_groups for p in g["params"]]
            out += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return [t for t in out if t.device.type == self.device.type]

    def resident_bytes(self) -> int:
        """Device bytes this role holds now in weights, grad buffers and optimizer state."""
        return resident_bytes(self.param_tensors() + self.grad_tensors() + self.optimizer_tensors(), self.device)

    def offload(self, params: bool = True, grads: bool = False, optimizer: bool = False) -> int:
        """Move the chosen state to host memory until `onload`; returns the bytes held there.
        Gradient buffers are freed, not copied: every mini-batch starts by zeroing them. On CUDA
        the caching allocator is emptied afterwards, so the rollout engine can take the memory."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stash = self.stash if self.offloaded else HostStash()
        done: set[int] = set()
        for on, tensors, keep in ((params, self.param_tensors, True), (optimizer, self.optimizer_tensors, True),
                                  (grads, self.grad_tensors, False)):
            if on:
                done |= stash.offload(tensors(), keep=keep, skip=done)
        self.stash, self.offloaded = stash, bool(stash)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return stash.nbytes

    def onload(self) -> None:
        if self.offloaded:
            self.stash.onload()
            self.offloaded = False
