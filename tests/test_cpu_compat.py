"""megarl/parallel/cpu_compat.py: the CPU shim is pinned to the megatron-core source it was
written for, and is entered at one boundary (the engine and its parts), not per method.

    python -m pytest -q tests/test_cpu_compat.py
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megarl.parallel import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is only installed without CUDA")


def test_installed_megatron_matches_the_checked_source():
    from megatron.core.package_info import __version__
    assert __version__ == cpu_compat.CHECKED_VERSION
    cpu_compat.verify_megatron()          # the installed 0.16.1 source hashes to the recorded table
    assert cpu_compat.fingerprints() == cpu_compat.FINGERPRINTS
    # every symbol install() touches is covered: the RNG fork and each wrapped backward
    assert "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork" in cpu_compat.FINGERPRINTS
    assert "megatron.core.tensor_parallel.mappings._GatherFromSequenceParallelRegion.backward" in \
        cpu_compat.FINGERPRINTS


def test_a_patched_symbol_that_differs_is_refused_in_one_line(monkeypatch):
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    def backward(ctx, grad):          # megatron's body changed under the same name
        return grad.clone()
    monkeypatch.setattr(mappings._ReduceFromModelParallelRegion, "backward", staticmethod(backward))
    with pytest.raises(cpu_compat.UnsupportedMegatron) as err:
        cpu_compat.verify_megatron()
    line = str(err.value)
    assert "\n" not in line
    assert "megatron.core.tensor_parallel.mappings._ReduceFromModelParallelRegion.backward differs" in line
    assert "megatron-core==0.16.1" in line
    monkeypatch.undo()

    class Extra(torch.autograd.Function):   # a version adding an autograd Function the shim never read
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g
    monkeypatch.setattr(moe_utils, "Extra", Extra, raising=False)
    with pytest.raises(cpu_compat.UnsupportedMegatron, match=r"test_cpu_compat\..*Extra\.backward is new"):
        cpu_compat.verify_megatron()


def test_install_refuses_a_differing_megatron_before_patching():
    """A fresh process whose megatron differs: install() (what init_distributed calls) stops
    with the one line and patches nothing."""
    code = textwrap.dedent("""
        import torch
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
        CudaRNGStatesTracker.fork = lambda self, name=None: None
        from megarl.parallel import cpu_compat
        try:
            cpu_compat.install()
        except cpu_compat.UnsupportedMegatron as err:
            print("REFUSED", err)
            print("ACTIVE", cpu_compat.active())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "ACTIVE"))]
    assert lines[0].startswith("REFUSED megatron-core 0.16.1: megatron.core.tensor_parallel.random."
                               "CudaRNGStatesTracker.fork differs"), out.stdout + out.stderr
    assert lines[1:] == ["ACTIVE False"]


def test_an_engine_method_without_a_decorator_runs_megatron_literals_on_cpu():
    """A method added to the engine (or any Boundary) later needs nothing to run megatron-style
    code on CPU; the same code outside the boundary fails, so the check can fail."""
    from megarl.workers.engine import MegatronEngine
    cpu_compat.install()

    def body(self):       # what megatron writes: the schedules' token counter, DDP's buffers
        return (torch.zeros([], dtype=torch.int, device="cuda").device,
                torch.empty(2, device=torch.cuda.current_device()).device,
                torch.ones(2).cuda().device)

    class Later(MegatronEngine):
        new_entry = body

    engine = Later.__new__(Later)               # no process group needed for this method
    assert engine.new_entry() == (torch.device("cpu"),) * 3
    with pytest.raises((RuntimeError, AssertionError)):
        body(engine)
