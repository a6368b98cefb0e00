"""The trainer loop (`python -m megarl.train`, 2 gloo ranks) under a virtual pipeline: the
quickstart's model with 4 layers at PP2 x VPP2, two GRPO steps with a checkpoint and a weight
sync per step; the trainer's log-probs must match the rollout engine's after the sync.
Sequence parallelism is on in every quickstart run (TP2: sequence_parallel defaults to on when
TP > 1), so tests/test_trainer_e2e.py exercises SP through the same loop.
"""
from __future__ import annotations

import os

import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, train


@pytest.mark.timeout(600)
def test_trainer_runs_with_virtual_pipeline(tmp_path):
    run = tmp_path / "vpp"
    code, out = finish(train([
        f"actor_rollout_ref.model.path={tmp_path / 'model4'}",
        "actor_rollout_ref.model.bootstrap=megarl.examples.addition:bootstrap",   # builds only its own path
        "actor_rollout_ref.model.bootstrap_kwargs={warm_start_steps: 20, seed: 0, max_digits: 2, eval_rows: 16, "
        "num_hidden_layers: 4}",
        f"trainer.default_local_dir={run}", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
        "algorithm.filter_groups.enable=false", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        # A barely warm model scores 0 everywhere (no GRPO signal); the entropy bonus still moves
        # the weights, so step 2's rollout runs on weights synced from the VPP chunks.
        "actor_rollout_ref.actor.entropy_coeff=0.01"]))
    assert code == 0, out[-3000:]
    assert "training layout: TP 1 x PP 2 x DP 1 (actor, reference); virtual pipeline 2 chunks per stage" in out
    records = read_metrics(str(run))
    steps = [r for r in records if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(r["actor/skipped_steps"] == 0 and r["actor/grad_norm"] > 0 for r in steps)
    # The trainer's log-probs (VPP forward) equal the engine's (weights synced from the chunks).
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in steps), steps
    assert os.path.isdir(run / "global_step_2" / "actor")
