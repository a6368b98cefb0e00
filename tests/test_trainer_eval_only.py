"""Evaluation without training, end to end (2 gloo ranks, megatron TP=2, the native engine):

- trainer.val_only=true validates the weights it resumes (or loads) at their step, logs val/* there
  and exits 0 without training or saving anything;
- trainer.total_training_steps=0 trains no step: validation before training (val_before_train), then 0.
"""
import json
import os

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, overrides, step_digests, train


def test_val_only_and_zero_steps_are_checked_at_config_time():
    with pytest.raises(ConfigError, match=r"^trainer.val_only: evaluates data.val_files, which is empty"):
        load_config(None, ["trainer.val_only=true"])
    with pytest.raises(ConfigError, match=r"^trainer.val_only: is not supported with rollout.placement=disagg"):
        load_config(None, ["trainer.val_only=true", "data.val_files=v.jsonl",
                           "actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=3",
                           "actor_rollout_ref.rollout.disaggregated_ranks=1", "algorithm.adv_estimator=gae"])
    assert load_config(None, ["trainer.total_training_steps=0"]).trainer.total_training_steps == 0
    with pytest.raises(ConfigError, match=r"^trainer.total_training_steps: must be >= 0"):
        load_config(None, ["trainer.total_training_steps=-1"])


@pytest.mark.timeout(900)
def test_val_only_validates_the_resumed_weights_and_zero_steps_train_nothing(addition_model_dir, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(line for line in list(open("data/addition/val.jsonl"))[:16]))
    common = [f"data.val_files={val}", "trainer.test_freq=-1"]
    run = tmp_path / "run"
    code, out = finish(train(overrides(addition_model_dir, run, *common, "trainer.total_training_steps=1",
                                       "trainer.save_freq=1", "trainer.val_before_train=false")))
    assert code == 0, out[-3000:]
    saved = step_digests(run / "global_step_1")

    # verl's main_generation (n samples per prompt written out) as megarl runs it: sampled validation,
    # dumped to trainer.validation_data_dir/<step>.jsonl
    code, out = finish(train(overrides(addition_model_dir, run, *common, "trainer.total_training_steps=1",
                                       "trainer.val_only=true", "trainer.val_before_train=false",
                                       "actor_rollout_ref.rollout.val_kwargs.n=2",
                                       "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                       "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                                       f"trainer.validation_data_dir={tmp_path / 'gen'}")))
    assert code == 0, out[-3000:]
    assert "trainer.val_only: validates the loaded weights, trains nothing" in out
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 1]
    assert "actor/pg_loss" in rows[0] and "val/accuracy" not in rows[0]
    assert rows[1]["val/samples"] == 32 and "actor/pg_loss" not in rows[1]
    dumped = [json.loads(line) for line in open(tmp_path / "gen" / "1.jsonl")]
    assert len(dumped) == 32 and len({d["input"] for d in dumped}) == 16
    assert sorted(p for p in os.listdir(run) if p.startswith("global_step_")) == ["global_step_1"]
    assert step_digests(run / "global_step_1") == saved          # nothing trained, nothing saved

    zero = tmp_path / "zero"
    code, out = finish(train(overrides(addition_model_dir, zero, *common, "trainer.total_training_steps=0",
                                       # a decaying schedule is built with a length all the same
                                       "actor_rollout_ref.actor.optim.lr_decay_style=cosine")))
    assert code == 0, out[-3000:]
    rows = read_metrics(str(zero))
    assert [r["step"] for r in rows] == [0] and rows[0]["val/samples"] == 16
    assert not [p for p in os.listdir(zero) if p.startswith("global_step_")]
    assert json.load(open(zero / "command.json"))["overrides"]     # the run's record is written as usual
