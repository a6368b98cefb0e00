"""A rank that runs out of memory says so in one line: which phase, what to lower, the limit.

One subprocess under a real address-space limit (`ulimit -v`: RLIMIT_AS just above what the process
holds) allocates through torch's CPU allocator and through Python inside the trainer's own phase
wrapper (RLTrainer.timed), and prints the line megarl/trainer/run.py prints.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import resource, types
    import torch
    from megarl.trainer.fit import RLTrainer
    from megarl.trainer.memory import PhaseMemory
    from megarl.trainer.out_of_memory import OutOfMemory, as_out_of_memory

    def vm_bytes():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmSize:"))
        return int(line.split()[1]) * 1024

    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + 256 * 2**20, resource.RLIM_INFINITY))
    trainer = types.SimpleNamespace(memory=PhaseMemory("cpu"), timings={})
    for phase, grab in (("gen", lambda: torch.empty(2**32)),             # 16 GiB of fp32
                        ("update_actor", lambda: bytearray(2**33))):    # 8 GiB through Python
        try:
            with RLTrainer.timed(trainer, phase):
                grab()
        except OutOfMemory as err:
            print("LINE", err)
    try:                                      # outside any phase: run.py's start-up line
        torch.ones(2**32)
    except (MemoryError, RuntimeError) as err:
        print("LINE", as_out_of_memory("start-up", err))
""")


def test_out_of_memory_under_ulimit_v_is_one_line_naming_phase_and_fix():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = [line[5:] for line in out.stdout.splitlines() if line.startswith("LINE ")]
    assert len(lines) == 3, out.stdout + out.stderr[-3000:]
    gen, update, start = lines
    assert gen.startswith("ran out of memory during gen (") and "rollout.n" in gen
    assert update.startswith("ran out of memory during update_actor (") and "ppo_micro_batch_size_per_gpu" in update
    assert start.startswith("ran out of memory during start-up (") and "tensor_model_parallel_size" in start
    for line in lines:
        assert "GiB (ulimit -v)" in line and "\n" not in line and "Traceback" not in line
