"""A rank that runs out of memory says so in one line: which phase, what to lower, the limit.

One subprocess under a real address-space limit (`ulimit -v`: RLIMIT_AS just above what the process
holds) allocates through torch's CPU allocator and through Python inside the trainer's own phase
wrapper (Steps.timed), and prints the line megarl/job/run.py prints. Then the whole command
path: `megarl-train` (launcher, torchrun, two ranks) under `ulimit -v`, one launch of one step that
saves nothing, gives one line at the command line and exit code 5; and the launcher's reading of
the two ways a rank can end out of memory (megarl's line, or native code aborting), in this process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megarl.launcher.output import RankOutput
from tests.faults.runs import overrides

CHILD = textwrap.dedent("""
    import resource, types
    import torch
    from megarl.trainer.loop.fit import RLTrainer
    from megarl.trainer.metrics.memory import PhaseMemory
    from megarl.trainer.control.out_of_memory import OutOfMemory, as_out_of_memory

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


def console_of(chunks: list[bytes], code: int, own: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """The launcher's console for `chunks`; `own`: the lines the ranks recorded as megarl's (own_line)."""
    import io
    import tempfile
    console = io.BytesIO()
    with tempfile.NamedTemporaryFile("w", suffix=".own-lines", delete=False) as f:
        f.write("".join(line + "\n" for line in own))
    echo = RankOutput(console, "run/logs/megarl-1.log", f.name)
    for chunk in chunks:
        echo.write(chunk)
    return echo.exit_code(code), console.getvalue().decode().splitlines()


def test_the_launcher_ends_on_a_ranks_out_of_memory_line_with_exit_code_5():
    line = ("megarl: stopped: rank 1: ran out of memory during gen (can't allocate memory) under an address-space "
            "limit of 1.9 GiB (ulimit -v); lower data.train_batch_size")
    code, lines = console_of([b"step 1/2 | reward 0.5\n", line.encode() + b"\nTraceback (most recent call last):\n",
                              b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"], 1, (line,))
    assert code == 5 and lines == ["step 1/2 | reward 0.5", line,
                                   "megarl: stopped the ranks; the ranks' full output is in run/logs/megarl-1.log"]
    # native code that aborts the rank (HF tokenizers' Rust allocator): its words and the innermost megarl frame
    dump = [b"memory allocation of 48 bytes failed\n", b"Fatal Python error: Aborted\n\nThread 0x7f (most recent call",
            b' first):\n  File "/venv/transformers/tokenization_utils_base.py", line 2553 in __call__\n',
            b'  File "/src/megarl/data/dataset.py", line 156 in _load\n  File "/src/megarl/train.py", line 1\n',
            b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"]
    code, lines = console_of([b"megarl: ranks: 2\n", *dump], 1)
    assert code == 5 and len(lines) == 2 and lines[0] == "megarl: ranks: 2", lines
    assert lines[1].startswith("megarl: stopped: a rank ran out of memory in native code (memory allocation of 48 "
                               "bytes failed, at megarl/data/dataset.py:156)"), lines
    assert lines[1].endswith("the ranks' full output is in run/logs/megarl-1.log"), lines
    # two ranks abort at once on one stderr, and Rust writes its line in pieces (seen under ulimit -v)
    torn = [b"megarl: ranks: 2\n", b"memory allocation of memory allocation of 6 bytes failed\n",
            b"skipping backtrace printing to avoid potential recursion\n", b"Fatal Python error: Aborted\n",
            b'  File "/src/megarl/data/build.py", line 371 in  bytes failed\nbuild_loadersmemory allocation of \n',
            b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"]
    code, lines = console_of(torn, 1)
    assert code == 5 and len(lines) == 2, lines
    assert lines[1].startswith("megarl: stopped: a rank ran out of memory in native code (memory allocation failed, "
                               "at megarl/data/build.py:371)"), lines


def test_a_bare_abort_is_out_of_memory_only_under_an_address_space_limit(monkeypatch):
    """An abort with no allocator's words (a C++ library's own error type, a thread stack that cannot
    map): under `ulimit -v` most likely memory, said as such; without a limit, the rank's own output."""
    from megarl.launcher import output
    dump = [b"megarl: ranks: 2\n", b"Fatal Python error: Aborted\n\nThread 0x7f (most recent call first):\n",
            b'  File "/src/megarl/trainer/loop/fit.py", line 90 in step\n', b"ChildFailedError:\n"]
    monkeypatch.setattr(output.resource, "getrlimit", lambda which: (2 << 30, 2 << 30))
    code, lines = console_of(dump, 1)
    assert code == 5 and len(lines) == 2, lines
    assert lines[1].startswith("megarl: stopped: a rank aborted in native code (at megarl/trainer/loop/fit.py:90) "
                               "under an address-space limit of 2.0 GiB (ulimit -v), most likely out of "
                               "memory; "), lines
    monkeypatch.setattr(output.resource, "getrlimit", lambda which: (output.resource.RLIM_INFINITY,) * 2)
    code, lines = console_of(dump, 1)
    assert code == 1 and "Fatal Python error: Aborted" in lines and "ChildFailedError:" in lines, lines


def test_megarl_train_under_ulimit_v_stops_in_one_line_with_exit_code_5(addition_model_dir, tmp_path):
    """The quickstart's ranks peak near 2.2 GiB of address space on CPU, the launcher under 0.9 GiB
    and torchrun under 0.75 GiB (VmPeak, 2 ranks): under 1.9 GiB only the ranks run out."""
    import shlex
    args = overrides(addition_model_dir, tmp_path / "run", 1, "trainer.save_freq=-1")
    cmd = (f"ulimit -v {1900 * 1024} && exec {shlex.quote(sys.executable)} -m megarl.train --config "
           f"configs/quickstart.yaml {' '.join(shlex.quote(str(a)) for a in args)}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    console = out.stdout + out.stderr
    memory = [line for line in console.splitlines() if "out of memory" in line]
    assert out.returncode == 5, console[-3000:]
    assert len(memory) == 1 and "under an address-space limit of 1.9 GiB (ulimit -v)" in memory[0], console[-3000:]
    assert "Traceback" not in console and "Fatal Python error" not in console, console[-3000:]


def test_a_thread_that_cannot_map_its_stack_under_a_limit_is_out_of_memory(monkeypatch):
    """gloo's process group starts threads; under `ulimit -v` their stacks may not map, and
    pthread_create's EAGAIN reaches Python as "Resource temporarily unavailable" (seen at start-up
    where the limit is tight). Without an address-space limit EAGAIN means a process-count limit."""
    from megarl.trainer.control import out_of_memory as oom
    err = RuntimeError("Resource temporarily unavailable")
    monkeypatch.setattr(oom.resource, "getrlimit", lambda which: (2 << 30, 2 << 30))
    assert oom.is_out_of_memory(err)
    assert str(oom.as_out_of_memory("start-up", err)).startswith(
        "ran out of memory during start-up (Resource temporarily unavailable) under an address-space limit of 2.0 GiB")
    monkeypatch.setattr(oom.resource, "getrlimit", lambda which: (oom.resource.RLIM_INFINITY,) * 2)
    assert not oom.is_out_of_memory(err)


def test_no_room_for_a_process_group_is_out_of_memory_not_a_hang(tmp_path):
    """Under ulimit -v a gloo group whose threads cannot map their stacks makes torch's
    ProcessGroupGloo constructor hang in its own clean-up (seen in CI: a rank waiting in
    pthread_cond_destroy for 10 minutes). megarl checks for room first: with 40 MiB left a group
    (3 thread stacks and an arena, 88 MiB) is refused as out of memory before torch starts it."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, resource, sys\n"
        "from megarl.parallel import address_space, state\n"
        "from megarl.trainer.control.out_of_memory import is_out_of_memory\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1])\n"
        "size = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (40 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    state.init_distributed(timeout_s=30)\n"
        "except MemoryError as err:\n"
        "    assert is_out_of_memory(err), err\n"
        "    print('refused:', err)\n"
        "    os._exit(0)\n"
        "print('started a group with 40 MiB left')\n"
        "os._exit(1)\n")
    from tests.distributed import free_port
    out = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "refused: cannot start a process group: " in out.stdout and "MiB of address space left" in out.stdout


def test_megatron_groups_are_checked_while_they_are_made():
    import torch.distributed as dist

    from megarl.parallel import address_space
    original = dist.new_group
    with address_space.checked_groups():
        assert dist.new_group is not original
    assert dist.new_group is original
