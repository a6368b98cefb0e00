"""CUDA-IPC bucket handles for the conformance fake (trtllm_fake.py), and the decoder the worker
extension uses. FAKE: this machine has no CUDA, so no real IPC handle can be made or opened.

What stands in, and what is real:
  - `reduce_cuda_like` returns what torch.multiprocessing.reductions.reduce_tensor returns for a
    CUDA tensor (torch 2.13 here): (rebuild_cuda_tensor, 15 arguments, the device at index 6,
    the allocation's handle bytes at index 7). Those bytes are torch's own CPU sharing of the
    tensor, pickled: they open in another process as a CUDA IPC handle would (TP ranks).
  - `loads` is the restricted unpickler the worker extension decodes with
    (tensorrt_llm/llmapi/rlhf_utils.py, main, index excerpt without a commit): builtins list,
    tuple, str, int, float, bool, bytes, dict, NoneType, type; modules matching ^torch.*;
    torch.storage._load_from_bytes, torch.hub._load_local and torch.save refused even so. Any
    other global is refused (tensorrt_llm.serialization's own defaults were not read: the fake
    approves nothing more). The message is ours.
  - `rebuild` replaces only torch's rebuild_cuda_tensor, after the extension has set argument 6
    to the worker's own device (`list_args[6] = self.device_id`).
"""
from __future__ import annotations

import base64
import io
import pickle
import re

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

APPROVED = {"builtins": {"list", "tuple", "str", "int", "float", "bool", "bytes", "dict", "NoneType", "type"}}
PATTERNS = [r"^torch.*"]
DISALLOWED = {"torch.storage": {"_load_from_bytes"}, "torch.hub": {"_load_local"}, "torch": {"save"}}


def reduce_cuda_like(tensor: torch.Tensor):
    """reduce_tensor's CUDA form for a tensor of this CPU (see the module docstring)."""
    handle = pickle.dumps(reduce_tensor(tensor))
    size_bytes = tensor.untyped_storage().nbytes()
    return (rebuild_cuda_tensor, (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(),
                                  torch.UntypedStorage, tensor.dtype, 0, handle, size_bytes, 0,
                                  tensor.requires_grad, b"", 0, None, False))


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in DISALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"Import {module}.{name} is not allowed")
        if name in APPROVED.get(module, ()) or any(re.match(p, module) for p in PATTERNS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Import {module}.{name} is not allowed")


def loads(data: bytes):
    return RestrictedUnpickler(io.BytesIO(data)).load()


def rebuild(func, args: list, device_id: int) -> torch.Tensor:
    """The extension's `list_args[6] = self.device_id; func(*list_args)`: the handle opens on the
    worker's own device whatever device the sender named."""
    if func is not rebuild_cuda_tensor:
        raise RuntimeError(f"a bucket handle rebuilt with {func!r}: TensorRT-LLM's workers open CUDA IPC handles "
                           "(torch's rebuild_cuda_tensor)")
    args = list(args)
    args[6] = device_id
    opened, opened_args = pickle.loads(args[7])          # the fake's cudaIpcOpenMemHandle
    return opened(*opened_args)


def decode(handles: dict, workers: list[str]) -> list:
    """Every worker opens its own handles (restricted unpickler, its own device). The fake holds
    one model for the TP group, so it refuses workers whose buckets differ; the real ones would
    each load their own and serve different models."""
    buckets = []
    for slot, uuid in enumerate(workers):
        if uuid not in handles:
            raise ValueError(f"Device UUID {uuid} not found in ipc_handles")
        blob = loads(base64.b64decode(handles[uuid]))
        if not isinstance(blob, list):
            raise ValueError(f"Deserialized data must be a list, got {type(blob).__name__} instead")
        buckets.append([(name, rebuild(func, args, slot)) for name, (func, args) in blob])
    for slot, other in enumerate(buckets[1:], 1):
        if [n for n, _ in other] != [n for n, _ in buckets[0]] or \
                any(not torch.equal(a, b) for (_, a), (_, b) in zip(other, buckets[0])):
            raise RuntimeError(f"TP worker {slot} received other tensors than worker 0: the ranks would serve "
                               "different models")
    return buckets[0]
