"""megatron-core imported without starting torch.compile's machinery.

    import_megatron()     # once per process, before megarl imports megatron (the rank entry points)

megatron-core 0.16 wraps its fused kernels (bias-GeLU, bias-SwiGLU, rotary, ...) in torch.compile as
its modules load, and torch.compile imports TorchDynamo and Inductor at the wrapping: about 2 s of
CPU in every process (megarl's trainer imports took 6.5 s, 4.4 s without it, on a 2-core machine),
though a CPU run never calls those kernels. While megatron loads, torch.compile is replaced by a
wrapper that calls torch.compile on the kernel's first call, which is when torch.compile compiles
anyway; then torch.compile is torch's own again.
"""
from __future__ import annotations

import functools
import sys

import torch


def import_megatron() -> None:
    if "megatron.core" in sys.modules:
        return
    compile_now = torch.compile

    def compile_on_first_call(model=None, **options):
        if model is None:                                    # @torch.compile(...) with options
            return lambda fn: compile_on_first_call(fn, **options)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)
        return call

    torch.compile = compile_on_first_call  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401 - the import this module exists to wrap
    finally:
        torch.compile = compile_now
