"""Run megatron-core 0.16.1 on CPU (gloo): the one place megarl bends megatron for a machine
without CUDA. Both entry points do nothing when CUDA is present; only megarl/parallel/state.py,
megarl/workers/engine.py and megarl/workers/checkpoint.py use them.

    cpu_compat.install()          # once per process (state.init_distributed does it)
    with cpu_compat.scope():      # around every call into megatron (engine methods, checkpoints)
        ...

What it replaces, and why (megatron-core assumes a CUDA device in these places):
  * `torch.cuda.current_device()` -> 0, mapped to CPU below. Pipeline p2p buffers, RoPE,
    tensor-parallel gather buffers and the GPT model ask it for their device.
  * inside `scope()`: `device="cuda"`, `device=0`, `torch.device("cuda")` in tensor factories and
    `Tensor.to`, and `Tensor.cuda()` -> CPU, through a `TorchFunctionMode`: the schedules (token
    counters), DDP grad buffers and `finalize_model_grads` write such literals. The mode costs a
    few microseconds per torch call, so it is scoped to megatron work and does not slow the rest
    of the process (a CPU rollout engine, reward code).
  * inside `scope()`: `pin_memory=True` in tensor factories -> False (context-parallel RoPE).
  * the backward of megatron's tensor-parallel autograd functions runs under the same mapping
    (autograd calls it outside the mode; SP allocates CUDA-literal buffers there).
  * megatron's CUDA RNG tracker `fork()` -> a no-op context (sequence parallelism forks it).
  * `torch.cuda.synchronize`, `torch.cuda.empty_cache` -> no-ops.
  * `torch.cuda.current_stream()/default_stream()/stream()` -> a stand-in whose `wait_stream` /
    `synchronize` do nothing (DDP and p2p call them even without overlap).
Core attention is NOT patched here: megarl's layer spec always uses its own SDPA core attention
(megarl/models/attention.py), which runs on either device. On CPU megarl also uses torch's AdamW
over megatron's `main_grad` instead of megatron's optimizer, whose grad clipping asserts CUDA
tensors (megarl/workers/optim.py).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_DEPTH = 0


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # megatron passes torch.cuda.current_device() (an int)
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_TO = {torch.Tensor.to}
_CUDA = {torch.Tensor.cuda}


class _CudaToCpu(TorchFunctionMode):
    """Maps every CUDA device argument to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CUDA:
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # no pinned allocator without CUDA (megatron's CP RoPE asks for one)
            kwargs = {**kwargs, "pin_memory": False}
        if func in _TO and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)) and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def wait_stream(self, *_):
        pass

    def synchronize(self):
        pass

    def wait_event(self, *_):
        pass

    def record_event(self, *_):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Install the torch.cuda stand-ins (idempotent). Returns True when active, False with CUDA."""
    global _INSTALLED
    if not needed():
        return False
    if _INSTALLED:
        return True
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: _NullStream()
    # Sequence parallelism forks megatron's CUDA RNG tracker around dropout; without CUDA there
    # is no CUDA generator to swap, and dropout draws from torch's CPU generator anyway.
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    _map_in_backward()
    _INSTALLED = True
    return True


def _map_in_backward() -> None:
    """Run the backward of megatron's tensor-parallel autograd functions under the CUDA->CPU
    mapping: autograd calls them outside any active TorchFunctionMode, and under sequence
    parallelism they allocate `device=torch.cuda.current_device()` buffers there."""
    import importlib
    from megatron.core.tensor_parallel import layers, mappings
    # MoE: the all-gather dispatcher's backward allocates on current_device() too.
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            with _CudaToCpu():
                return backward(ctx, *grads)
        return staticmethod(run)

    for module in (layers, mappings, moe_utils):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and "backward" in vars(obj):
                obj.backward = wrap(vars(obj)["backward"].__func__ if isinstance(vars(obj)["backward"], staticmethod)
                                    else vars(obj)["backward"])


@contextlib.contextmanager
def scope():
    """Map CUDA device arguments to CPU for the duration (re-entrant; nothing when not installed).
    Megatron's backward runs inside too: on CPU autograd uses the calling thread."""
    global _DEPTH
    if not _INSTALLED or _DEPTH:
        yield
        return
    _DEPTH += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        _DEPTH -= 1


def scoped(fn):
    """Decorator: run `fn` inside scope()."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)
    return run


def active() -> bool:
    return _INSTALLED
