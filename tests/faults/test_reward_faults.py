"""Rewards that fail: NaN on part of a batch is counted (metric) and told (console line; the run is
conftest.py's scored_run, whose reward is NaN on a quarter of the samples); in the
Ray pool, a hung reward (past reward_model.batch_deadline_s) and a raising one stop the run with
the reward named as the root cause in torchrun's summary, not rank 1's "Connection closed"; a
reward scored in rank 0 that calls os._exit(0) fails the run (rc != 0) with one line naming it."""
import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.faults.runs import Launch, overrides

REWARDS = '''
import math, time

# Both fail on the model's wrong answers only: the launcher scores one row with its own ground
# truth before any rank starts (preflight), so a reward that fails on everything stops there.
def hangs(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.strip() != str(ground_truth):
        time.sleep(3600)
    return 1.0

def exits(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.strip() != str(ground_truth):
        import os
        os._exit(0)
    return 1.0

def raises(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.strip() != str(ground_truth):
        raise ZeroDivisionError("the grader divided by zero")
    return 1.0
'''


def _launch(model_dir, tmp_path, name, *extra):
    (tmp_path / "rewards.py").write_text(REWARDS)
    return Launch(overrides(model_dir, tmp_path / name, 1, "trainer.save_freq=-1",
                            f"custom_reward_function.path={tmp_path / 'rewards.py'}",
                            f"custom_reward_function.name={name}", *extra))


def test_nan_on_part_of_a_batch_is_counted_and_printed(scored_run):
    rc, out = scored_run["rc"], scored_run["out"]
    assert rc == 0, out[-3000:]
    row = next(r for r in read_metrics(str(scored_run["dir"])) if r["step"] == 1)
    nan = int(row["reward/non_finite"])
    assert 0 < nan < 32 and row["reward/failures"] == nan, row
    assert f"megarl: step 1: {nan} of 32 samples failed to score ({nan} non-finite, 0 timed out)" in out, out[-3000:]


def _root_cause(out):
    return out.split("Root Cause (first observed failure):", 1)[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, cause", [
    ("hangs", "RewardDeadline: the reward step passed reward_model.batch_deadline_s="),
    ("raises", "RewardFailure: the reward function failed on "),
])
def test_ray_pool_reward_is_the_root_cause(addition_model_dir, tmp_path, name, cause):
    launch = _launch(addition_model_dir, tmp_path, name, "reward_model.launch_reward_fn_async=true",
                     "reward_model.batch_deadline_s=8", "reward_model.timeout_s=60", "reward_model.num_workers=2")
    rc, out = launch.finish()
    assert rc != 0
    root = _root_cause(out)
    assert cause in root and "Connection closed" not in root, out[-3000:]
    assert "ZeroDivisionError: the grader divided by zero" in root if name == "raises" else True
    assert sum(line.startswith("megarl: stopped:") for line in out.splitlines()) == 1, out[-3000:]
    assert launch.left_after(10) == []


@pytest.mark.timeout(300)
def test_a_reward_that_exits_inside_a_rank_fails_the_run_naming_it(addition_model_dir, tmp_path):
    rc, out = _launch(addition_model_dir, tmp_path, "exits").finish()
    assert rc != 0, out[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("megarl: stopped:")]
    assert len(stopped) == 1 and "rewards.py:exits called os._exit(0) while scoring a batch of 32" in stopped[0], \
        out[-3000:]
    assert "Connection reset by peer" not in _root_cause(out), out[-3000:]
