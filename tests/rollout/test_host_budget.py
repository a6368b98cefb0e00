"""On CPU a rank's memory is bounded by design (megarl/rollout/native/host_budget.py): the native
engine's KV cache is sized from this rank's share of host memory (or kv_cache_gb), and a run that
would not fit stops when the engine is built, with one line naming the key to change.

The share is checked against psutil's reading of the host (an outside oracle), and the refusals
are real: a real engine, real /proc figures, LOCAL_WORLD_SIZE as launchers set it.
"""
import psutil
import pytest

from megarl.config.errors import ConfigError
from megarl.models.tiny import make_tiny_hf
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.native import NativeEngine, host_budget
from megarl.rollout.registry import build_rollout

GiB = 2**30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("budget") / "m"), "qwen2", tokenizer=False)


def test_share_is_host_memory_over_local_ranks(monkeypatch):
    host = host_budget.host_memory_bytes()
    assert host is not None and host <= psutil.virtual_memory().total
    assert host >= psutil.virtual_memory().total * 0.5 or host_budget._cgroup_limit() == host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_budget.rank_share_bytes() == host // 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")                    # bare launches: the world is local
    assert host_budget.rank_share_bytes() == host // 2


def test_cpu_budget_follows_the_share_and_bounds_the_cache(model_dir, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    engine = NativeEngine.from_pretrained(model_dir, gpu_memory_utilization=0.5)
    share = host_budget.rank_share_bytes()
    budget = engine._budget_bytes()
    rss = psutil.Process().memory_info().rss
    assert budget is not None and abs(budget - (0.5 * share - rss)) < 64 * 2**20   # never unbounded on CPU
    # The rows a call gets shrink to what the budget holds: a budget of 3 rows' K/V gives 3 rows.
    per_row, per_group = engine.row_costs(16, 16)
    engine.kv_cache_gb = (3 * per_row + 3 * per_group) / GiB
    engine.generate([list(range(1, 17))] * 8, SamplingParams(n=1, max_tokens=16, seed=0))
    assert engine.cache.rows == 3
    # A call whose smallest cache (n rows, one prompt) exceeds the budget stops with the key to change.
    with pytest.raises(ConfigError, match=r"engine_kwargs\.native\.kv_cache_gb"):
        engine.generate([[1, 2, 3]], SamplingParams(n=8, max_tokens=16, seed=0))
    engine.kv_cache_gb = None
    engine.gpu_memory_utilization = 0.5 * rss / share               # less than the process already holds
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.gpu_memory_utilization: ") as err:
        engine.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=16, seed=0))
    assert "\n" not in str(err.value)


def test_a_run_that_would_not_fit_stops_at_build(model_dir, monkeypatch):
    # 100000 ranks on this host: a share of a few hundred KiB, less than the process holds.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    key = r"^actor_rollout_ref\.rollout\.gpu_memory_utilization: "
    with pytest.raises(ConfigError, match=key + r".*100000 local") as err:
        build_rollout(RolloutConfig(prompt_length=64, response_length=64, n=4), model_dir)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    # An explicit kv_cache_gb too small for n rows of prompt + response: that key is named.
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.engine_kwargs\.native\.kv_cache_gb: n=4 rows"):
        build_rollout(RolloutConfig(prompt_length=64, response_length=64, n=4,
                                    engine_kwargs={"native": {"kv_cache_gb": 1e-6}}), model_dir)
    # ... and one larger than the rank's share.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    huge = host_budget.host_memory_bytes() / GiB
    with pytest.raises(ConfigError, match=r"kv_cache_gb: .*more than this rank's share"):
        build_rollout(RolloutConfig(prompt_length=64, response_length=64, n=4,
                                    engine_kwargs={"native": {"kv_cache_gb": huge}}), model_dir)
    # What fits builds (the bucket buffers count: 2 x 512 MiB by default).
    build_rollout(RolloutConfig(prompt_length=64, response_length=64, n=4), model_dir)
