"""The disaggregated, one-step off-policy trainer end to end (rollout.placement=disaggregated):
3 processes started by `python -m megarl.train` as users start it: ranks 0-1 train (megatron
TP 2 over those two only), rank 2 runs the native engine; weights cross over the checkpoint
engine's distributed transport.

- metrics carry the staleness histogram (batch 1 on-policy, later ones one version behind),
  the mismatch, and the masked-token share of the IcePop correction;
- SIGKILL of the rollout rank stops the whole job, naming the rank and the signal, and leaves
  the last checkpoint intact; the resumed run logs exactly (bitwise, CPU fp32) the metrics of a
  run that was never killed, because the in-flight batch travels in the checkpoint.
"""
import os
import time

import psutil
import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, stable, train

STEPS = 4


def overrides(model_dir, run_dir, *extra):
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2", "trainer.test_freq=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "algorithm.filter_groups.enable=false",
            "trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.placement=disaggregated",
            "actor_rollout_ref.rollout.disaggregated_ranks=1", "algorithm.rollout_correction.rollout_is=icepop",
            "algorithm.rollout_correction.rollout_is_threshold=1.5", "trainer.plot_reward_curve=false", *extra]


def rank_process(proc, rank: int):
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "megarl.train" in " ".join(p.cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.timeout(600)
def test_async_run_then_rollout_rank_killed_then_exact_resume(addition_model_dir, tmp_path):
    # Run A: never killed.
    run_a = tmp_path / "a"
    code, out = finish(train(overrides(addition_model_dir, run_a)))
    assert code == 0, out[-3000:]
    assert "megarl: training layout: TP 2 x PP 1 x DP 1" in out      # megatron spans the 2 trainer ranks only
    assert "disaggregated (ranks 2-2)" in out
    rows = read_metrics(str(run_a))
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert rows[1]["async/staleness_hist/0"] == 1.0 and rows[1]["async/staleness_max"] == 0
    for r in rows[2:]:
        assert r["async/staleness_hist/1"] == 1.0 and r["async/staleness_mean"] == 1.0
    for r in rows[1:]:
        assert 0.0 <= r["rollout_corr/masked_token_fraction"] <= 1.0 and "rollout_corr/kl" in r
        assert r["weight_sync/gb"] > 0 and "timing_s/wait_rollout" in r
    assert {r["step"] for r in rows if "val/accuracy" in r} == {0, 2, 4}

    # Run B: SIGKILL the rollout rank once step 2 is checkpointed.
    run_b = tmp_path / "b"
    proc = train(overrides(addition_model_dir, run_b))
    pointer = run_b / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not (pointer.is_file() and pointer.read_text().strip() == "2"):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.02)
    victim = rank_process(proc, 2)
    assert victim is not None
    victim.kill()
    killed_at = time.time()
    code, out = finish(proc, timeout=120)
    assert code != 0 and time.time() - killed_at < 60, out[-3000:]
    assert "rank      : 2" in out or "rank: 2" in out, out[-3000:]
    assert "Signal 9" in out or "SIGKILL" in out, out[-3000:]
    assert pointer.read_text().strip() in ("2", "4")
    assert os.path.isfile(run_b / f"global_step_{pointer.read_text().strip()}" / "trainer_state.pt")

    code, out = finish(train(overrides(addition_model_dir, run_b)))
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    resumed = {r["step"]: r for r in read_metrics(str(run_b))}
    assert sorted(resumed) == list(range(STEPS + 1))
    for step in range(3, STEPS + 1):
        assert stable(resumed[step]) == stable(rows[step]), step

