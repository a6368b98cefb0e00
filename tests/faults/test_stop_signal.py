"""SIGTERM to `megarl-train` (what Slurm sends at preemption and at the time limit): the ranks finish
the step they are in, save it, say so in one line and exit 143; the same command resumes there and
ends bitwise (CPU fp32) as the run that was never stopped (the sync reference run, conftest.py; the
stopped launch opens the sync kill chain's run, so the resume is that chain's first launch).
A step that does not end within trainer.stop_grace_s: exit 143 and one line saying nothing was saved."""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time

import pytest

from megarl.trainer.control.stopping import StopRequest
from tests.faults.conftest import STEPS, check_same_as_reference


@pytest.mark.timeout(1200)
def test_sigterm_saves_at_the_step_boundary_exits_143_and_resumes_exactly(sync_chain):
    """The sync kill chain's first launch (conftest.py) is the one stopped: SIGTERM once it has
    started; the chain's next launch is the same command, resuming there."""
    stop = sync_chain["stop"]
    assert stop["left"] == []
    rc, out = stop["rc"], stop["out"]
    lines = [line for line in out.splitlines() if line.startswith("megarl: stopped by SIGTERM")]
    assert rc == 143 and len(lines) == 1, out[-3000:]
    step = int(re.match(rf"megarl: stopped by SIGTERM after step (\d) of {STEPS}; saved ", lines[0]).group(1))
    assert 1 <= step < STEPS and lines[0].endswith(f"global_step_{step}; the same command resumes there")
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert stop["pointer"] == str(step)
    # Step 1 is not a save_freq step: the stop's own save is timed in its record, and the next start
    # (launch/slurm/job.sh, megarl/launcher/vars.py) names it beside the stop signal's margin.
    record, = [r for r in stop["records"] if r["step"] == step]
    assert step == 1 and record["timing_s/save_checkpoint"] > 0, stop["records"]
    assert len(stop["next_start"]) == 1 and stop["next_start"][0].endswith(
        f"the last save took {record['timing_s/save_checkpoint']:.1f} s and a step {record['timing_s/step']:.1f} s "
        f"(step 1 in {sync_chain['run']}/metrics.jsonl)"), stop["next_start"]

    # The resume, up to its own kill point, and the chain's end: every step's metrics and the last
    # step's weights and optimizer state as the run never stopped (the sync reference run).
    resumed = sync_chain["kills"][0]["out"]
    assert f"at step {step}" in resumed, resumed[-3000:]
    assert sync_chain["rc"] == 0, sync_chain["out"][-3000:]
    check_same_as_reference(sync_chain)


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
