"""A rank that stops (SIGSTOP: alive, silent) fails the others within trainer.collective_timeout_s,
with one line naming the timeout and its key, on a real 2-rank `megarl-train` run."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.faults.runs import Launch, overrides, run_processes

TIMEOUT_S = 15      # above the longest gap between two collectives of a loaded 2-core machine
STEPS = 60


def _rank_pid(tag: str, rank: int) -> int:
    for p in run_processes(tag):
        env = p.environ()
        if env.get("RANK") == str(rank) and "megarl.train" in p.cmdline():
            return p.pid
    raise AssertionError(f"rank {rank} not found")


@pytest.mark.timeout(300)
def test_a_stopped_rank_fails_the_others_within_the_collective_timeout(addition_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS, "trainer.save_freq=-1",
                              f"trainer.collective_timeout_s={TIMEOUT_S}"))
    try:
        deadline = time.monotonic() + 240
        while not any(f"step 2/{STEPS} " in log.read_text(errors="replace") for log in run_dir.glob("logs/*.log")):
            assert launch.proc.poll() is None, launch.finish()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.2)
        stopped = time.monotonic()
        os.kill(_rank_pid(launch.tag, 1), signal.SIGSTOP)
        try:
            rc, out = launch.finish(timeout=TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {TIMEOUT_S + 60}s after rank 1 stopped (trainer.collective_timeout_s="
                        f"{TIMEOUT_S}); a group ignores the collective timeout")
        seconds = time.monotonic() - stopped
    finally:
        if launch.proc.poll() is None:
            launch.kill_group()
    assert rc != 0
    assert f"a collective waited past trainer.collective_timeout_s={TIMEOUT_S}s" in out, out[-3000:]
    assert seconds < TIMEOUT_S + 45, f"took {seconds:.0f}s"
