"""Run megatron-core 0.16.1 on CPU (gloo): the one place megarl bends megatron for a machine
without CUDA. Nothing is installed or entered when CUDA is present.

    cpu_compat.install()            # once per process: state.init_distributed does it
    class MegatronEngine(cpu_compat.Boundary): ...   # every method of the engine and its parts
                                                      # runs inside scope(); nothing else enters it
    python -m megarl.parallel.cpu_compat --fingerprints   # after reading a new megatron's source

The boundary is the engine (megarl/workers/engine.py) and its four parts: they are the only
objects that call into megatron, and every method defined on a Boundary subclass is entered
through scope(), so a new method cannot forget it. install() refuses, in one line, a
megatron-core whose patched functions differ from the 0.16.1 source this file was written for
(FINGERPRINTS below).

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
  * megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` -> an empty state / a no-op: activation
    recompute (tensor_parallel.checkpoint) saves and restores the CUDA generator around each
    recomputed forward; the CPU generator, which CPU dropout draws from, it restores itself.
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
import importlib
import inspect

import torch
from megatron.core.package_info import __version__ as MEGATRON_VERSION
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

from megarl.config.errors import ConfigError
from megarl.models.mcore import fingerprint

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


@functools.cache
def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Install the torch.cuda stand-ins (idempotent). Returns True when active, False with CUDA.
    Refuses (UnsupportedMegatron, one line) a megatron-core whose patched functions differ from
    the source this shim was checked against."""
    global _INSTALLED
    if not needed():
        return False
    if _INSTALLED:
        return True
    verify_megatron()
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: _NullStream()
    # Sequence parallelism forks megatron's CUDA RNG tracker around dropout; without CUDA there
    # is no CUDA generator to swap, and dropout draws from torch's CPU generator anyway.
    fork = vars(CudaRNGStatesTracker)["fork"]

    @functools.wraps(fork)     # (keeps megatron's function reachable for fingerprints())
    def no_fork(self, name=None):
        return contextlib.nullcontext()
    CudaRNGStatesTracker.fork = no_fork
    get_state, set_state = vars(mcore_random)["_get_cuda_rng_state"], vars(mcore_random)["_set_cuda_rng_state"]

    @functools.wraps(get_state)
    def no_cuda_state(*a, **k):
        return torch.empty(0, dtype=torch.uint8)

    @functools.wraps(set_state)
    def keep_cuda_state(*a, **k):
        return None
    mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state = no_cuda_state, keep_cuda_state
    for cls in _backward_classes():
        cls.backward = _in_mode(vars(cls)["backward"])
    _INSTALLED = True
    return True


# -- what is patched, pinned to the megatron-core source it was written for -------------------------
# The stand-ins above assume what these megatron functions do (allocate on current_device(), fork
# a CUDA generator). Each entry is a fingerprint (sha256 of the function's AST: comments and
# layout do not count) of megatron-core 0.16.1's source; a version where one differs, is missing or
# adds an autograd Function with its own backward is refused: the shim is unchecked there.
# Regenerate after reading the new source: python -m megarl.parallel.cpu_compat --fingerprints
CHECKED_VERSION = "0.16.1"
FINGERPRINTS = {
    'megatron.core.tensor_parallel.layers.LinearWithFrozenWeight.backward': '04c8c092434c2602',
    'megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward': 'ae5e70562c9d6ec5',
    'megatron.core.tensor_parallel.mappings._AllGatherFromTensorParallelRegion.backward': 'aa9b1c4761b989da',
    'megatron.core.tensor_parallel.mappings._AllToAll.backward': '42840faed516195c',
    'megatron.core.tensor_parallel.mappings._CopyToModelParallelRegion.backward': 'cb8f7f9a723b222e',
    'megatron.core.tensor_parallel.mappings._GatherFromModelParallelRegion.backward': 'ea2317c5c19ba486',
    'megatron.core.tensor_parallel.mappings._GatherFromSequenceParallelRegion.backward': '5fcb7a40d8cf528b',
    'megatron.core.tensor_parallel.mappings._ReduceFromModelParallelRegion.backward': 'a40d72988641319e',
    'megatron.core.tensor_parallel.mappings._ReduceScatterToSequenceParallelRegion.backward': 'bed96d2e70f2f87b',
    'megatron.core.tensor_parallel.mappings._ReduceScatterToTensorParallelRegion.backward': 'a673277f9c60b8af',
    'megatron.core.tensor_parallel.mappings._ScatterToModelParallelRegion.backward': 'a673277f9c60b8af',
    'megatron.core.tensor_parallel.mappings._ScatterToSequenceParallelRegion.backward': 'cc73078d2ace82ef',
    'megatron.core.tensor_parallel.random.CheckpointFunction.backward': '307d89d93ce624af',
    'megatron.core.tensor_parallel.random.CheckpointWithoutOutputFunction.backward': 'db73f45d89e2eebb',
    'megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork': '8a55c86259e819a9',
    'megatron.core.tensor_parallel.random._get_cuda_rng_state': 'e4df6cbf9c1daf88',
    'megatron.core.tensor_parallel.random._set_cuda_rng_state': '69b0392cac63211b',
    'megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.backward': 'e68f72ecf35bff6d',
    'megatron.core.transformer.moe.moe_utils.RandomSTE.backward': 'a89ba05a176ad0c1',
    'megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.backward': '00d1eaa3176acd19',
}


class UnsupportedMegatron(ConfigError):
    """The environment's megatron-core is not the one the shim was checked against (megarl-train
    prints it as one line and exits 2, like any preflight error)."""


def _backward_classes() -> list[type]:
    """megatron's autograd Functions whose backward runs under the CUDA->CPU mapping: autograd
    calls them outside any active TorchFunctionMode, and under sequence parallelism (and MoE's
    all-gather dispatcher) they allocate `device=torch.cuda.current_device()` buffers there."""
    found = []
    # random: the recompute Functions re-run a layer's forward inside their backward
    for name in ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
                 "megatron.core.tensor_parallel.random", "megatron.core.transformer.moe.moe_utils"):
        for obj in vars(importlib.import_module(name)).values():
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and "backward" in vars(obj) \
                    and obj not in found:
                found.append(obj)
    return found


def _patched_functions() -> dict:
    """{qualified name: megatron's own function} for every symbol install() replaces or wraps."""
    out = {"megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork": vars(CudaRNGStatesTracker)["fork"],
           "megatron.core.tensor_parallel.random._get_cuda_rng_state": vars(mcore_random)["_get_cuda_rng_state"],
           "megatron.core.tensor_parallel.random._set_cuda_rng_state": vars(mcore_random)["_set_cuda_rng_state"]}
    for cls in _backward_classes():
        fn = vars(cls)["backward"]
        out[f"{cls.__module__}.{cls.__qualname__}.backward"] = fn.__func__ if isinstance(fn, staticmethod) else fn
    return out


def fingerprints() -> dict[str, str]:
    # install()'s own wrappers (functools.wraps) lead back to megatron's functions
    return {name: fingerprint(fn) for name, fn in sorted(_patched_functions().items())}


def verify_megatron(expected: dict[str, str] | None = None) -> None:
    """Raise UnsupportedMegatron (one line) unless every patched symbol matches `expected`
    (default: FINGERPRINTS, megatron-core 0.16.1)."""
    expected = FINGERPRINTS if expected is None else expected
    got = fingerprints()
    for name in sorted(set(got) | set(expected)):
        if got.get(name) != expected.get(name):
            how = "is new" if name not in expected else "is missing" if name not in got else "differs"
            raise UnsupportedMegatron(
                f"megatron-core {MEGATRON_VERSION}: {name} {how} from the {CHECKED_VERSION} source megarl's CPU shim "
                f"(megarl/parallel/cpu_compat.py) was checked against; on CPU install megatron-core=={CHECKED_VERSION} "
                "(on CUDA no shim is used)")


def _in_mode(backward):
    fn = backward.__func__ if isinstance(backward, staticmethod) else backward

    @functools.wraps(fn)
    def run(ctx, *grads):
        with _CudaToCpu():
            return fn(ctx, *grads)
    return staticmethod(run)


@contextlib.contextmanager
def scope():
    """Map CUDA device arguments to CPU for the duration (re-entrant; nothing when not installed).
    Megatron's backward runs inside too: on CPU autograd uses the calling thread."""
    global _DEPTH
    if _DEPTH or not install():      # (install: once per process; False when CUDA is present)
        yield
        return
    _DEPTH += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        _DEPTH -= 1


def _scoped(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)
    return run


class Boundary:
    """Base of every object that calls into megatron (the engine and its parts,
    megarl/workers/engine.py): each method and property defined on a subclass runs inside
    scope(), so a method added later cannot miss it. A generator method is scoped while it is
    called, not while it is iterated (the caller's code runs between its items)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, attr in list(vars(cls).items()):
            if name in ("__init_subclass__", "__class_getitem__"):
                continue
            if inspect.isfunction(attr):
                setattr(cls, name, _scoped(attr))
            elif isinstance(attr, (staticmethod, classmethod)):
                setattr(cls, name, type(attr)(_scoped(attr.__func__)))
            elif isinstance(attr, property):
                setattr(cls, name, property(*(f and _scoped(f) for f in (attr.fget, attr.fset, attr.fdel)),
                                            attr.__doc__))


def active() -> bool:
    return _INSTALLED


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--fingerprints"]:
        sys.exit("usage: python -m megarl.parallel.cpu_compat --fingerprints")
    for key, value in fingerprints().items():
        print(f"    {key!r}: {value!r},")
