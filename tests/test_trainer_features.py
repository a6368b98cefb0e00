"""Trainer options end to end, one short real run each (2 gloo ranks, megatron TP=2, native engine):

- PPO: GAE with a critic, KL to the reference both in the reward (adaptive coefficient) and as a
  loss, rewards scored in a Ray pool in parallel with the log-prob passes by a function that
  raises on some samples and hangs on others: the run goes on and counts them;
- DAPO dynamic sampling with clip-higher, scored by a reward model (critic backbone + score head).
"""
import os
import subprocess
import sys

import pytest
import torch

from megarl.trainer.metrics.logger import read_metrics


def short(addition_model_dir, run_dir, *extra):
    return ["--config", "configs/quickstart.yaml", f"actor_rollout_ref.model.path={addition_model_dir}",
            f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
            "algorithm.filter_groups.enable=false", "actor_rollout_ref.actor.clip_ratio_high=0.2", *extra]


def run(args, timeout=600):
    out = subprocess.run([sys.executable, "-m", "megarl.train", *args], capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.timeout(700)
def test_ppo_with_critic_kl_and_a_flaky_reward_in_a_ray_pool(addition_model_dir, tmp_path):
    code, out = run(short(addition_model_dir, tmp_path / "ppo",
                          "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "trainer.save_freq=2",
                          "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                          "actor_rollout_ref.actor.use_kl_loss=true",
                          "reward_model.launch_reward_fn_async=true", "reward_model.num_workers=2",
                          "reward_model.timeout_s=2", "reward_model.failure_score=0.0",
                          "custom_reward_function.path=tests/assets/flaky_reward.py",
                          # token-budget micro-batches for every pass (actor, reference, critic), packed;
                          # the row count at verl's null (token budgets only)
                          "actor_rollout_ref.actor.use_dynamic_bsz=true",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48"))
    assert code == 0, out[-4000:]
    rows = read_metrics(str(tmp_path / "ppo"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("critic/vf_loss", "critic/values/mean", "critic/grad_norm", "actor/kl_loss",
                    "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "timing_s/values",
                    "timing_s/ref", "timing_s/update_critic", "reward/failures", "reward/timeouts"):
            assert key in r, key
        # packed at TP2 x PP1: no compute on padding beyond rounding each pack to a multiple of TP (SP)
        assert 1.0 <= r["perf/padding_ratio"] <= 1.05
    assert sum(r["reward/failures"] for r in rows) > 0     # the raising samples were counted,
    assert sum(r["reward/timeouts"] for r in rows) > 0     # the hanging ones cut off and counted
    assert "megarl: training layout: TP 2 x PP 1 x DP 1 (actor, reference, critic)" in out
    assert os.path.isdir(tmp_path / "ppo" / "global_step_2" / "critic")


@pytest.mark.timeout(700)
def test_dapo_dynamic_sampling_scored_by_a_reward_model(addition_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForSequenceClassification
    lm = AutoModelForCausalLM.from_pretrained(addition_model_dir, dtype=torch.float32)
    cfg = lm.config
    cfg.num_labels = 1
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg)
    rm.model.load_state_dict(lm.model.state_dict())
    rm_dir = str(tmp_path / "rm")
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(addition_model_dir).save_pretrained(rm_dir)

    code, out = run(short(addition_model_dir, tmp_path / "dapo",
                          "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                          "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                          "reward_model.enable=true", f"reward_model.model.path={rm_dir}"))
    assert code == 0, out[-4000:]
    rows = read_metrics(str(tmp_path / "dapo"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["dapo/groups_kept"] >= 8 and r["dapo/gen_rounds"] >= 1
        # A random score head gives real-valued scores that differ within every group.
        assert r["critic/score/max"] > r["critic/score/min"]

    # With a 0/1 reward some groups do not vary: they are dropped and the engine, put to sleep
    # after each step's rollout (free_cache_engine), generates more rounds within one step.
    code, out = run(short(addition_model_dir, tmp_path / "dapo_rounds", "algorithm.filter_groups.enable=true",
                          "algorithm.filter_groups.metric=acc", "actor_rollout_ref.rollout.free_cache_engine=true",
                          "custom_reward_function.path=tests/assets/length_parity_reward.py"))
    assert code == 0, out[-4000:]
    rows = read_metrics(str(tmp_path / "dapo_rounds"))
    assert max(r["dapo/gen_rounds"] for r in rows) >= 2, [r["dapo/gen_rounds"] for r in rows]
    assert all(r["dapo/groups_kept"] >= 8 for r in rows)
