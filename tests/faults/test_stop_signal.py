"""SIGTERM to `megarl-train` (what Slurm sends at preemption and at the time limit): the ranks finish
the step they are in, save it, say so in one line and exit 143; the same command resumes there and
ends bitwise (CPU fp32) as the run that was never stopped (the sync reference run, conftest.py).
A step that does not end within trainer.stop_grace_s: exit 143 and one line saying nothing was saved."""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time

import pytest

from megarl.trainer.metrics import read_metrics
from megarl.trainer.stopping import StopRequest
from tests.faults.conftest import STEPS
from tests.faults.runs import Launch, overrides
from tests.helpers.training_runs import stable, step_digests


@pytest.mark.timeout(900)
def test_sigterm_saves_at_the_step_boundary_exits_143_and_resumes_exactly(sync_reference, addition_model_dir, tmp_path):
    run_dir = tmp_path / "stopped"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS))
    try:
        deadline = time.monotonic() + 300
        while not any(f"step 1/{STEPS} " in log.read_text(errors="replace") for log in run_dir.glob("logs/*.log")):
            assert launch.proc.poll() is None, launch.finish()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 1"
            time.sleep(0.1)
        launch.proc.send_signal(signal.SIGTERM)        # the launcher only, as `kill <pid>` does
        rc, out = launch.finish(timeout=300)
    finally:
        if launch.proc.poll() is None:
            launch.kill_group()
    assert launch.left_after(10) == []
    lines = [line for line in out.splitlines() if line.startswith("megarl: stopped by SIGTERM")]
    assert rc == 143 and len(lines) == 1, out[-3000:]
    step = int(re.match(rf"megarl: stopped by SIGTERM after step (\d) of {STEPS}; saved ", lines[0]).group(1))
    assert 1 <= step < STEPS and lines[0].endswith(f"global_step_{step}; the same command resumes there")
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)

    rc, out = Launch(overrides(addition_model_dir, run_dir, STEPS)).finish()
    assert rc == 0 and f"at step {step}" in out, out[-3000:]
    ref = {r["step"]: r for r in read_metrics(str(sync_reference["dir"]))}
    got = {r["step"]: r for r in read_metrics(str(run_dir))}
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert stable(got[s]) == stable(ref[s]), s
    last = f"global_step_{STEPS}"
    assert step_digests(run_dir / last) == step_digests(sync_reference["dir"] / last)


def _stuck_after_sigterm(stderr_path):
    sys.stderr = open(stderr_path, "w")       # pytest's capture is not this child's to write
    StopRequest(grace_s=1).install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)                            # a step that never reaches its boundary


def test_a_step_that_outlives_the_grace_period_exits_143_saying_nothing_was_saved(tmp_path):
    stderr = tmp_path / "stderr"
    child = multiprocessing.get_context("fork").Process(target=_stuck_after_sigterm, args=(str(stderr),))
    child.start()
    child.join(45)
    if child.is_alive():
        child.kill()
        pytest.fail("still running 45 s after SIGTERM with trainer.stop_grace_s=1")
    assert child.exitcode == 143
    assert stderr.read_text().strip() == (
        "megarl: stopped by SIGTERM: no step ended within trainer.stop_grace_s=1s, so nothing was saved; the same "
        "command resumes from the last checkpoint (raise trainer.stop_grace_s to save on a stop)")
