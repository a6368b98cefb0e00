"""SIGKILL of one rank, of launch/torchrun.sh and of megarl-train: within 10 s no process of the
run is left and the run directory's lock is free. Each run is killed after its first save, which
starts no helper process (megatron-core's own would spawn a multiprocessing Manager there; megarl
gives its writer an in-process queue, megarl/workers/checkpoint.py).

Before the fixes, killing a rank left megatron's helper holding the launcher's pipe and megarl-train
waited on it forever; killing launch/torchrun.sh left torchrun and both ranks training."""
import os
import signal
import time

import pytest

from tests.faults.runs import Launch, lock_is_free, overrides

STEPS = 4


def _helpers(launch) -> list:
    from tests.faults.runs import run_processes
    return [p for p in run_processes(launch.tag) if "multiprocessing" in " ".join(p.cmdline())]


def _check_gone(launch, run_dir, killed_at):
    left = launch.left_after(10 - (time.monotonic() - killed_at))
    assert left == [], [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    assert lock_is_free(run_dir)


@pytest.mark.timeout(300)
def test_sigkill_of_one_rank(addition_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS), fault="pause@step:3:1")
    pid = launch.wait_paused()
    assert not _helpers(launch), "a save started a helper process"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rc, out = launch.finish(timeout=60)          # megarl-train returns instead of waiting on the pipe
    assert rc != 0 and "Signal 9 (SIGKILL)" in out, out[-3000:]
    _check_gone(launch, run_dir, killed_at)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", [True, False], ids=["launch/torchrun.sh", "megarl-train"])
def test_sigkill_of_the_launcher(addition_model_dir, tmp_path, script):
    run_dir = tmp_path / "run"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS), fault="pause@step:3", script=script)
    launch.wait_paused()
    assert not _helpers(launch), "a save started a helper process"
    launch.proc.send_signal(signal.SIGKILL)      # the script (bash) or megarl-train only
    killed_at = time.monotonic()
    launch.finish(timeout=60)
    _check_gone(launch, run_dir, killed_at)
    assert not os.path.exists(run_dir / "global_step_4")     # nothing went on training
