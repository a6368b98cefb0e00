"""launch/torchrun.sh for real: 2 gloo ranks on this machine, resume, and every way a rank can die.

The ranks run megarl.launcher.check (MEGARL_ENTRY), a real distributed job that takes
megarl-train's arguments, until the trainer lands; the script, torchrun and the process group are
the ones megarl.train runs under.
"""
import os
import subprocess
import sys
import time

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.job.launch_env import check_launch, rank_env, shell_assignments
from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.checkout import unbuilt_model

SCRIPT = "launch/torchrun.sh"


def torchrun(run_dir, *overrides, env=None, timeout=120):
    full_env = {**os.environ, "PYTHON": sys.executable, "MEGARL_ENTRY": "megarl.launcher.check", **(env or {})}
    start = time.monotonic()
    # the model as a fresh clone has it (to be bootstrapped), whatever the checkout's runs/models holds
    out = subprocess.run(["bash", SCRIPT, "configs/quickstart.yaml", f"trainer.default_local_dir={run_dir}",
                          *unbuilt_model(os.path.dirname(run_dir)), *overrides], env=full_env, capture_output=True,
                         text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.timeout(240)
def test_two_ranks_run_log_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, _ = torchrun(run_dir, "trainer.total_training_steps=3", "trainer.save_freq=1")
    assert rc == 0, out[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {r["launch/world_size"] for r in records} == {2}
    assert records[-1]["launch/acc"] == 3 * (1 + 2 + 3)       # (1 + 2) x step, summed over steps
    logs = list((run_dir / "logs").glob("torchrun-*.log"))
    assert len(logs) == 1 and "step 3/3" in logs[0].read_text()

    # The same command with a longer run continues after the latest checkpoint, by itself.
    rc, out, _ = torchrun(run_dir, "trainer.total_training_steps=5", "trainer.save_freq=1")
    assert rc == 0, out[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["launch/resumed_from"] for r in records[3:]] == [3, 3]
    assert records[-1]["launch/acc"] == 3 * 15


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, why", [
    ("raise", "RuntimeError: injected failure on rank 1 at step 2"),
    ("kill", "Signal 9 (SIGKILL) received"),
])
def test_a_dead_rank_ends_every_rank_and_is_named(tmp_path, mode, why):
    rc, out, seconds = torchrun(tmp_path / "run", "trainer.total_training_steps=50", "trainer.collective_timeout_s=60",
                                env={"MEGARL_CHECK_FAIL": f"1:2:{mode}", "MEGARL_CHECK_STEP_S": "0.1"})
    assert rc != 0
    # torchrun's summary lists every rank that ended; rank 1's entry says why. (Its "Root Cause"
    # is the earliest error file, which after a SIGKILL can be rank 0's "connection reset".)
    summary = out.split("megarl.launcher.check FAILED", 1)[1]
    entries = summary.split("\n[")[1:]
    rank1 = [e for e in entries if "rank      : 1 (local_rank: 1)" in e]
    assert rank1 and why in rank1[0], out[-3000:]
    # rank 0 is stopped too (gloo sees the peer go, torchrun ends the rest), long before the
    # 60 s collective timeout; the bound leaves room for a loaded 2-core machine.
    assert any("rank      : 0 (local_rank: 0)" in e for e in entries)
    assert seconds < 45, f"took {seconds:.0f}s"
    assert "launch_check: done" not in out


@pytest.mark.timeout(300)
def test_a_hung_rank_is_cut_off_by_the_collective_timeout(tmp_path):
    """Rank 1 stays alive but stops taking part: rank 0's all_reduce gives up after
    trainer.collective_timeout_s, and torchrun then ends rank 1."""
    rc, out, seconds = torchrun(tmp_path / "run", "trainer.total_training_steps=5", "trainer.collective_timeout_s=4",
                                env={"MEGARL_CHECK_FAIL": "1:2:hang"})
    assert rc != 0
    assert "Timed out waiting 4000ms" in out, out[-3000:]
    assert "rank      : 1 (local_rank: 1)" in out and "(SIGTERM)" in out
    assert 4 < seconds < 60, f"took {seconds:.0f}s"


def test_bad_config_stops_before_any_rank_starts(tmp_path):
    rc, out, _ = torchrun(tmp_path / "run", "actor_rollout_ref.rollout.tmperature=1")
    assert rc == 2
    assert "megarl: config error: actor_rollout_ref.rollout.tmperature: unknown key; did you mean" in out
    assert "torch.distributed.run" not in out and not (tmp_path / "run").exists()
    rc, out, _ = torchrun(tmp_path / "run", "trainer.nnodes=2")
    assert rc == 2 and "trainer.nnodes: is 2, but launch/torchrun.sh (NNODES=1) runs on 1 node(s)" in out


def test_rank_env_and_launch_checks_name_the_mismatch():
    cfg = load_config("configs/quickstart.yaml")
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    got = rank_env(cfg, env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (1, 2, 1, 2)
    with pytest.raises(ConfigError, match="started 4 processes but trainer.nnodes x trainer.n_gpus_per_node = 1 x 2"):
        rank_env(cfg, {**env, "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="MASTER_PORT not set"):
        rank_env(cfg, {k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ConfigError, match="trainer.n_gpus_per_node: is 2, but srun starts 8"):
        check_launch(cfg, 1, 8, by="srun")
    check_launch(cfg, 1, 2, by="srun")
    cfg = load_config("configs/quickstart.yaml",
                      ["trainer.collective_timeout_s=12.5", "trainer.default_local_dir=/x/y"])
    sh = shell_assignments(cfg)
    assert (sh["MEGARL_RUN_DIR"], sh["MEGARL_LOG_DIR"], sh["MEGARL_COLLECTIVE_TIMEOUT_S"]) == \
        ("/x/y", "/x/y/logs", "13")
