"""The trainer end to end on real parts: megatron actor (TP=2 over gloo), the native engine,
rule rewards, step checkpoints. Each run is `python -m megarl.train` started as users start it.

- a short quickstart run logs verl's metric names, validation, the resolved config, a curve,
  generation dumps, and keeps the last two checkpoints;
- NaN updates are skipped with a warning and the run stops after trainer.max_bad_steps.
(Resumes after SIGKILL at every kill point, and after an interrupted save: tests/faults/.)
"""
import json
import os
import re

import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, overrides, train

@pytest.mark.timeout(900)
def test_a_short_run_logs_dumps_validates_and_keeps_checkpoints_as_verl_does(addition_model_dir, tmp_path):
    """Metrics, generation dumps, validation and checkpoint retention of a 6-step run. (Its resume
    after a SIGKILL between a checkpoint and its metrics record: tests/faults/test_kill_resume.py.)"""
    run_a = tmp_path / "a"
    dumps = [f"trainer.rollout_data_dir={tmp_path / 'gen'}", f"trainer.validation_data_dir={tmp_path / 'val'}",
             "trainer.log_val_generations=3"]
    code, out = finish(train(overrides(addition_model_dir, run_a, *dumps)))
    assert code == 0, out[-3000:]
    rows = read_metrics(str(run_a))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "response_length/mean",
                "timing_s/gen", "perf/throughput", "rollout_corr/max_abs_log_prob_diff",
                # verl's names too
                "training/global_step", "training/epoch", "timing_s/old_log_prob", "perf/cpu_memory_used_gb",
                "global_seqlen/min", "global_seqlen/balanced_max", "response/aborted_ratio"):
        assert all(key in r for r in rows[1:]), key
    assert [r["training/global_step"] for r in rows[1:]] == [1, 2, 3, 4, 5, 6]
    assert {r["step"] for r in rows if "timing_s/save_checkpoint" in r} == {2, 4, 6}
    assert {r["step"] for r in rows if "val/accuracy" in r} == {0, 3, 6}
    # verl's per-source validation names, with the single source of the addition task
    assert {r["step"] for r in rows if "val-core/addition/acc/mean@1" in r} == {0, 3, 6}
    assert rows[3]["val-core/addition/acc/mean@1"] == rows[3]["val/addition/accuracy"]
    # generation dumps as verl writes them: a file per step, the reward's extra keys (acc, pred) on each line
    assert sorted(os.listdir(tmp_path / "gen")) == [f"{s}.jsonl" for s in range(1, 7)]
    assert sorted(os.listdir(tmp_path / "val")) == ["0.jsonl", "3.jsonl", "6.jsonl"]
    lines = [json.loads(line) for line in open(tmp_path / "gen" / "2.jsonl")]
    assert len(lines) == 8 * 4 and {"input", "output", "gts", "score", "step", "acc", "pred"} <= set(lines[0])
    assert {line["step"] for line in lines} == {2}
    assert sum(line["score"] for line in lines) == pytest.approx(rows[2]["critic/score/mean"] * len(lines))
    picked = [json.loads(line) for line in open(run_a / "val_generations.jsonl")]
    assert [p["step"] for p in picked] == [0] * 3 + [3] * 3 + [6] * 3
    assert re.search(r"^step 3/6 \| reward [0-9.]+ \| kl .* \| val_acc", out, re.M), out[-2000:]
    assert "megarl: training layout: TP 2 x PP 1 x DP 1" in out
    assert (run_a / "config.yaml").is_file() and (run_a / "reward_curve.png").is_file()
    assert sorted(os.listdir(run_a / "global_step_6")) == ["actor", "manifest.json", "rng", "trainer_state.pt"]
    assert not (run_a / "global_step_2").exists()          # keep the last 2
    # The engine reports the log-probs the actor recomputes after each weight sync.
    assert max(r["rollout_corr/max_abs_log_prob_diff"] for r in rows[1:]) < 1e-4


@pytest.mark.timeout(600)
def test_nan_updates_are_skipped_then_the_run_stops(addition_model_dir, tmp_path):
    # An absurd learning rate overflows the weights at the first update; every later loss is NaN.
    run = tmp_path / "nan"
    code, out = finish(train(overrides(addition_model_dir, run, "actor_rollout_ref.actor.optim.lr=1e30",
                                       "trainer.max_bad_steps=2", "trainer.test_freq=-1", "trainer.save_freq=1")))
    assert code != 0
    assert "skipped for a NaN/inf loss or grad norm" in out
    assert "more than trainer.max_bad_steps=2" in out
    rows = read_metrics(str(run))
    bad = [r["training/bad_steps"] for r in rows if "training/bad_steps" in r]
    assert bad[-1] == 3 and bad == sorted(bad)
    # The last checkpoint is intact and loadable.
    from megarl.trainer.checkpoints.checkpointing import latest_step_dir
    last = latest_step_dir(str(run))
    assert last is not None and os.path.isfile(os.path.join(last, "trainer_state.pt"))
