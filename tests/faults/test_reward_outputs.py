"""Reward functions that misbehave in ways a rank cannot contain by catching Exception: they end the
process (sys.exit, os._exit), return an integer beyond float range, return a tensor of the wrong
shape, or ignore their timeout. Each becomes one RewardFailure line naming the reward (the loop
hands it to every rank), or, for the stuck call, rank 0 ends itself naming the deadline.
In this process, except the stuck call, which must end its process and so runs in a forked child."""
import multiprocessing
import os
import sys
import tempfile
import time

import pytest

from megarl.experiment import load_config
from megarl.reward.loading import RewardFnSpec
from megarl.reward.settings import RewardSettings
from megarl.reward.manager import RewardFailure, RewardManager, build_reward_manager
from megarl.reward.scorers import InProcessScorer
from tests.helpers.reward import rollout_batch, tokenizer

REWARDS = '''
import os, sys, time
import torch

def sys_exits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(0)

def batch_os_exits(data_sources, solution_strs, ground_truths, extra_infos):
    os._exit(0)

def batch_huge(data_sources, solution_strs, ground_truths, extra_infos):
    return [10**400 for _ in solution_strs]

def ignores_timeout(data_source, solution_str, ground_truth, extra_info=None):
    while True:                 # swallows SIGALRM's exception each time it arrives
        try:
            time.sleep(0.05)
        except BaseException:
            pass

class WrongShape:
    def __call__(self, data):
        return torch.zeros(3)
'''


@pytest.fixture()
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _score(*overrides):
    manager = build_reward_manager(load_config(None, list(overrides)), tokenizer())
    return manager.result(manager.compute_async(rollout_batch(["5", "6"], ["5", "5"], source="x")))


def test_sys_exit_in_a_per_sample_reward_is_one_failure_line(rewards):
    with pytest.raises(RewardFailure) as info:
        _score(f"custom_reward_function.path={rewards}", "custom_reward_function.name=sys_exits")
    msg = str(info.value)
    assert f"custom_reward_function {rewards}:sys_exits called sys.exit(0) while scoring a batch of 2" in msg, msg


def _in_fork(target, *args, timeout=90) -> tuple[int, str]:
    """Run target(stderr_path, *args) in a forked child (this process has torch loaded already; an exit
    that escapes must end the child, not pytest): its exit code and what it wrote to stderr."""
    with tempfile.NamedTemporaryFile(prefix="megarl-fault-") as stderr:
        child = multiprocessing.get_context("fork").Process(target=target, args=(stderr.name, *args))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            pytest.fail(f"the child still ran after {timeout} s")
        return child.exitcode, open(stderr.name).read()


def _failure_line(stderr_path, *overrides):
    sys.stderr = open(stderr_path, "w")      # pytest's capture is not this child's to write
    try:
        _score(*overrides)
    except RewardFailure as err:
        print(f"RewardFailure: {err}", file=sys.stderr, flush=True)
        os._exit(7)


def test_os_exit_in_a_batch_reward_thread_is_one_failure_line(rewards):
    code, err = _in_fork(_failure_line, f"custom_reward_function.path={rewards}",
                         "custom_reward_function.name=batch_os_exits", "reward_model.reward_manager=batch")
    assert code == 7, f"exit code {code}: {err[-2000:]}"
    assert f"RewardFailure: custom_reward_function {rewards}:batch_os_exits called os._exit(0) while scoring" in err


def test_a_batch_reward_of_ten_to_the_400_names_the_overflow(rewards):
    with pytest.raises(RewardFailure) as info:
        _score(f"custom_reward_function.path={rewards}", "custom_reward_function.name=batch_huge",
               "reward_model.reward_manager=batch")
    assert "returned an integer of 1329 bits, beyond a float's range" in str(info.value), info.value


def test_a_custom_manager_of_the_wrong_shape_names_the_class(rewards):
    with pytest.raises(RewardFailure) as info:
        _score(f"reward_model.reward_manager={rewards}:WrongShape")
    assert str(info.value) == (f"reward_model.reward_manager {rewards}:WrongShape: WrongShape(batch) has shape "
                               "(3,); expected [2] or (2, 8)")


def _stuck(stderr_path, path):
    sys.stderr = open(stderr_path, "w")
    scorer = InProcessScorer(tokenizer(), RewardFnSpec(path, "ignores_timeout"), timeout_s=0.5)
    manager = RewardManager(tokenizer(), scorer, RewardSettings(deadline_s=1))
    manager(rollout_batch(["5", "6"], ["5", "5"], source="x"))


def test_a_reward_that_ignores_its_timeout_ends_the_rank_at_the_deadline(rewards):
    start = time.monotonic()
    code, err = _in_fork(_stuck, str(rewards))
    assert code == 3, err[-2000:]
    assert time.monotonic() - start < 60
    stopped = [line for line in err.splitlines() if line.startswith("megarl: stopped:")]
    assert len(stopped) == 1 and stopped[0].startswith(
        "megarl: stopped: the reward step passed reward_model.batch_deadline_s=1s on a batch of 2 samples"), stopped
    assert "ignoring its timeout" in stopped[0]
