"""`megarl-train` with rollout.name=vllm, end to end on 2 ranks: vLLM at rollout TP 2 colocated with
the actor at TP 2, and vLLM on a rollout rank of its own (disaggregated, one-step off-policy).

Each run checks what only a real launch shows: vLLM's own TP group is megarl's rollout group (the
engine refuses to start otherwise), and the log-probs vLLM reports for its samples equal the
trainer's for the same tokens (`rollout_corr/max_abs_log_prob_diff`, measured before the step's
first optimizer step) after every weight sync. Where vllm does not import these skip, except
under CI=1, where a missing vLLM fails them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.rollout.fixtures import require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    require_vllm()
    return str(tmp_path_factory.mktemp("vllm_train") / "addition-h64")


def train(run_dir, model_path: str, *overrides: str) -> list[dict]:
    # configs/quickstart_vllm.yaml's model (heads of 64, as vLLM's CPU attention needs), warm-started
    # briefly; small batches: the point is the engine's layout and its log-probs, not the reward
    cmd = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "quickstart_vllm.yaml"),
           # a bootstrap builds only the path its own config names: named again beside the path
           f"actor_rollout_ref.model.path={model_path}",
           "actor_rollout_ref.model.bootstrap=megarl.examples.addition:bootstrap",
           "actor_rollout_ref.model.bootstrap_kwargs.warm_start_steps=30",
           "actor_rollout_ref.model.bootstrap_kwargs.eval_rows=16", f"trainer.default_local_dir={run_dir}",
           "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "trainer.plot_reward_curve=false", "algorithm.filter_groups.enable=false",
           "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHDYNAMO_DISABLE": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if row.get("step", 0) > 0]


@pytest.mark.timeout(700)
def test_vllm_at_rollout_tp2_colocated_trains_with_exact_log_probs_after_every_sync(tmp_path, model_path):
    # what a SIGKILLed TP-2 run leaves in /dev/shm (vLLM's names for the group of ranks 0-1), which
    # made the next run's vLLM fail with "create shm in SHMManager failed. errno: 17"
    for rank in (0, 1):
        with open(f"/dev/shm/-tp:0-[0-1]-cpushm_{rank}", "ab"):
            pass
    rows = train(tmp_path / "tp2", model_path, "trainer.total_training_steps=4",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    gaps = [r["rollout_corr/max_abs_log_prob_diff"] for r in rows]
    # four syncs: the first brings the weights, three more carry a policy update each
    assert len(gaps) == 4 and max(gaps) <= TOL, gaps
    assert all(r["rollout_corr/bypass_mode"] == 1.0 for r in rows)     # exact at fp32: no old-log-prob pass
    log = open(next((tmp_path / "tp2" / "logs").glob("megarl-*.log"))).read()
    assert "'tensor_parallel_size': 2" in log and "external_launcher" in log
    assert "left by a vLLM run that did not exit cleanly" in log, log[-2000:]


@pytest.mark.timeout(700)
def test_vllm_on_a_rollout_rank_of_its_own_trains_one_step_off_policy(tmp_path, model_path):
    rows = train(tmp_path / "disagg", model_path, "trainer.total_training_steps=3",
                 "actor_rollout_ref.rollout.placement=disaggregated", "actor_rollout_ref.rollout.disaggregated_ranks=1",
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1")
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    # batch 1 was sampled from the weights the trainer scores it with (version 0, the first sync)
    assert rows[0]["rollout_corr/max_abs_log_prob_diff"] <= TOL, rows[0]
