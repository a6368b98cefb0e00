"""A disk that fills up during a save: one line per rank naming the step, the failed rank and the
cause, no lost-connection traceback from the peer rank, no second traceback from the launcher,
the launcher's log not cut, the last good checkpoint intact; the next launch is refused by the
preflight's free-space check, in one line, before any rank starts.

The run directory is a 10 MiB tmpfs (room for one checkpoint of the test model, not two) where
the suite runs as root; elsewhere the fault hook fails the save with ENOSPC instead (the
preflight half then has no full disk to find, and is skipped)."""
import os
import subprocess

import pytest

from megarl.trainer.checkpoints import verified_io
from tests.faults.runs import Launch, overrides


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    ok = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mnt)],
                                              capture_output=True).returncode == 0
    yield mnt, ok
    if ok:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["disk", "rank 1 only"])
def test_disk_full_during_a_save(addition_model_dir, small_disk, tmp_path, where):
    """`disk`: the tmpfs fills (as root; else rank 0's write is failed by the fault hook). `rank 1
    only`: only rank 1's own file fails, so rank 0, which cleans up and publishes, learns it from the
    ranks' agreement."""
    mnt, mounted = small_disk
    if where != "disk":       # a disk with room: only the injected write fails
        mnt, mounted = tmp_path, False
    run_dir = mnt / "run"
    fault = None if mounted else "enospc@save:4:1" if where != "disk" else "enospc@save:4"
    launch = Launch(overrides(addition_model_dir, run_dir, 4), fault=fault)
    rc, out = launch.finish()
    assert rc != 0
    stopped = [line for line in out.splitlines() if line.startswith("megarl: stopped: saving step 4 failed")]
    assert stopped and "No space left on device" in stopped[0], out[-3000:]
    assert "the last complete checkpoint is " + str(run_dir / "global_step_2") in stopped[0]
    # one line per rank, each naming the rank whose write failed: the ranks agree on a save's failure
    # before going on, so the peer stops with the same cause instead of a lost-connection traceback
    # (a real full tmpfs may fail both; the line names the lowest rank that found the cause)
    assert len(stopped) == 2 and all("No space left on device" in line for line in stopped), out[-6000:]
    if fault:
        failed = fault.rsplit(":", 1)[-1] if where != "disk" else "0"
        assert all(line.startswith(f"megarl: stopped: saving step 4 failed on rank {failed}:") for line in stopped), \
            stopped
    assert "Connection closed by peer" not in out and "Connection reset by peer" not in out, out[-3000:]
    # the launcher adds no traceback of its own (a failing log.flush() is one line)
    assert "log.flush" not in out and "in spawn_ranks" not in out, out[-3000:]
    assert "CheckpointSaveError: saving step 4 failed" in out.split("Root Cause (first observed failure):")[-1]
    log = next((run_dir / "logs").glob("megarl-*.log")).read_text()
    assert stopped[0] in log                            # the log holds the ranks' last words
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "2"
    verified_io.verify(str(run_dir / "global_step_2"))         # every file matches its save-time digest
    assert not (run_dir / "global_step_4.tmp").exists() and not (run_dir / "global_step_4").exists()
    if where != "disk":
        return
    if not mounted:
        pytest.skip("no tmpfs (not root): the preflight's free-space check was not exercised")
    rc, out = Launch(overrides(addition_model_dir, run_dir, 4)).finish()
    assert rc == 2, out[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megarl: config error: trainer.default_local_dir: "
                                                   f"{run_dir} has "), out
    assert "MiB free, but a checkpoint of this run needs about" in lines[0]
