"""Move a role's device memory to host memory and back, in place, around the rollout.

    stash = HostStash()
    stash.offload(tensors, keep=True)   # each distinct storage: copied to host, then resized to 0 bytes
    ...                                 # the engine generates in the freed memory
    stash.onload()                      # same storages regrown and refilled: every view sees its data again

Storages, not tensors, move: megatron's DDP keeps params and grads as views into flat buffers
(`param.main_grad`, the distributed optimizer's `param_data`), and megatron-core's own
`_ParamAndGradBuffer.offload_to_cpu` uses the same resize-to-zero trick, so views, optimizer
references and autograd hooks stay valid. `keep=False` frees without a copy and returns zeros
(gradient buffers, which the next mini-batch zeroes anyway). The same code runs on CPU, where
"leaving" means the original storage holds 0 bytes and a separate host copy holds the data; it
saves nothing there (device memory is host memory), so the workers only call it on CUDA.
"""
from __future__ import annotations

import warnings

import torch


class HostStash:
    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, torch.UntypedStorage | None, int]] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self._held)

    @torch.no_grad()
    def offload(self, tensors, keep: bool = True, skip: set[int] | None = None) -> set[int]:
        """Offload the distinct, non-empty storages behind `tensors` (those whose data pointer is in
        `skip` are left alone). Returns the data pointers handled, for the caller's next `skip`."""
        skip = set(skip or ())
        seen: set[int] = set()
        pinned = False
        for t in tensors:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in seen or ptr in skip:
                continue
            seen.add(ptr)
            host = None
            if keep:
                cuda = st.device.type == "cuda"
                host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda).untyped_storage()
                host.copy_(st, non_blocking=cuda)
                pinned |= cuda
            self._held.append((st, host, n))
        if pinned:
            torch.cuda.synchronize()   # the copies must land before the device blocks are freed
        for st, _, _ in self._held:
            st.resize_(0)
        return seen

    @torch.no_grad()
    def onload(self) -> None:
        cuda = False
        for st, host, n in self._held:
            st.resize_(n)
            if host is None:
                torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,)).zero_()
            else:
                cuda |= st.device.type == "cuda"
                st.copy_(host, non_blocking=st.device.type == "cuda")
        if cuda:
            torch.cuda.synchronize()
        self._held.clear()


def resident_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages behind `tensors` that sit on `device` now."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.device.type == device.type and st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def offload_plan(mc, role: str, trainable: bool, device: torch.device) -> dict | None:
    """The engine.offload(...) arguments that `role.megatron.{param,grad,optimizer}_offload` ask
    for, or None; where they cannot act, one warning says why."""
    if mc is None:
        return None
    asked = {"params": mc.param_offload, "grads": mc.grad_offload, "optimizer": mc.optimizer_offload}
    if not any(asked.values()):
        return None
    keys = ", ".join(f"{role}.megatron.{k}" for k, on in zip(("param_offload", "grad_offload", "optimizer_offload"),
                                                               asked.values()) if on)
    if device.type != "cuda":
        warnings.warn(f"{keys}: no effect on {device.type}: the device's memory is host memory, there is nothing "
                      "to free for the rollout engine", stacklevel=2)
        return None
    if not trainable and (asked["grads"] or asked["optimizer"]):
        warnings.warn(f"{keys}: a frozen role has no gradients or optimizer state; only its weights move",
                      stacklevel=2)
        asked["grads"] = asked["optimizer"] = False
    return asked if any(asked.values()) else None


class RoleMemory:
    """offload()/onload() for a worker holding `self.engine` and `self.offload_kw` (offload_plan)."""
    offload_kw: dict | None = None

    def offload(self) -> int:
        """Trainer state to host memory for the rollout (bytes moved; 0 when nothing is asked)."""
        return self.engine.offload(**self.offload_kw) if self.offload_kw else 0

    def onload(self) -> None:
        self.engine.onload()
