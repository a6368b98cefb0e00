"""The Ray scoring pool on a real local Ray (one module, one Ray start for all its tests)."""
import time

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.reward.manager import RewardFailure, build_reward_manager
from tests.helpers.reward import rollout_batch, tokenizer

FUNCS = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise KeyError("boom")
    if ground_truth == "hang":
        time.sleep(3600)                     # a C-level sleep: only killing the worker ends it
    if ground_truth == "exit":
        os._exit(3)
    if ground_truth == "slow":
        time.sleep(1.0)
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
'''


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def funcs(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "pool_funcs.py"
    path.write_text(FUNCS)
    return str(path)


def manager_for(funcs, *extra):
    cfg = load_config(None, [f"custom_reward_function.path={funcs}", "reward_model.launch_reward_fn_async=true",
                             "reward_model.num_workers=2", "reward_model.timeout_s=2", "reward_model.failure_score=-1",
                             *extra])
    return build_reward_manager(cfg, tokenizer())


@pytest.mark.timeout(180)
def test_pool_contains_raising_hanging_and_dying_functions(ray_cluster, funcs):
    manager = manager_for(funcs, "reward_model.max_failure_fraction=0.6")
    try:
        batch = rollout_batch(["5", "5", "5", "5", "6"], ["5", "raise", "hang", "exit", "6"], source="x")
        t = time.perf_counter()
        future = manager.compute_async(batch)
        assert time.perf_counter() - t < 0.5                # returns at once; scoring runs meanwhile
        res = manager.result(future)
        elapsed = time.perf_counter() - t
        assert 2.0 <= elapsed < 30                          # bounded by the 2 s timeout, not the hour
        assert res.token_level_scores.sum(-1).tolist() == [1.0, -1.0, -1.0, -1.0, 1.0]
        assert res.metrics["reward/timeouts"] == 1 and res.metrics["reward/failures"] == 2
        assert res.extra_info["reward_failed"] == [False, True, True, True, False]
        pids = {p for p in res.extra_info["pid"] if p is not None}
        assert 1 <= len(pids) <= 2 and all(isinstance(p, int) for p in pids)
        assert manager.scorer.pool.replaced == 2                   # the hung and the dead worker
        # the run goes on with a whole pool
        again = manager(rollout_batch(["7", "8"], ["7", "9"], source="x"))
        assert again.token_level_scores.sum(-1).tolist() == [1.0, 0.0]
        assert manager.totals == {"failures": 2, "timeouts": 1}
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_pool_scores_in_parallel_and_stops_above_the_failure_fraction(ray_cluster, funcs):
    manager = manager_for(funcs, "reward_model.max_failure_fraction=0.3")
    try:
        t = time.perf_counter()
        res = manager(rollout_batch(["1", "2", "3", "4"], ["slow"] * 4, source="x"))
        # four 1 s calls on two workers take about 2 s, not 4
        assert time.perf_counter() - t < 3.5
        assert res.metrics["reward/failures"] == 0
        with pytest.raises(RewardFailure, match="failed on 2 of 4 samples"):
            manager(rollout_batch(["1", "2", "3", "4"], ["raise", "raise", "1", "4"], source="x"))
    finally:
        manager.close()


def test_pool_refuses_a_bad_function_before_starting(ray_cluster, funcs):
    with pytest.raises(ConfigError, match="has no function named 'missing'"):
        manager_for(funcs, "custom_reward_function.name=missing")
