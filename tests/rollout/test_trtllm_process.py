"""TensorRT-LLM in megarl's processes: which Ray its executor runs in (the job's node cluster, or
the LLM's own) beside megarl's Ray pools, the environment its Ray workers inherit, GPU memory
while asleep, and the torch its wheel wants, against the conformance fake (tests/rollout/trtllm_fake*.py).

FAKES: tensorrt_llm cannot run here, and a real Ray per engine test costs seconds (the real one:
tests/rollout/test_trtllm_node_ray.py); nothing here shows the real packages behave so.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.trtllm import TRTLLMEngine, placement
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import state_of, trtllm_config

V29 = "trtllm-1.3.0rc29.json"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


cfg = trtllm_config


# -- Ray in the leader's process ------------------------------------------------------------------------
def test_trtllm_refuses_a_process_whose_ray_megarl_started(monkeypatch, dirs):
    """megarl's reward pool started a Ray of the process's own first: the job's node cluster cannot
    be joined from it (one Ray per process), and the LLM's workers would land in a Ray without
    the node's GPUs. The engine refuses in one line and leaves the pool's Ray alone."""
    trtllm_fake.install(monkeypatch, V29)
    ray = sys.modules["ray"]
    ray.init(num_cpus=2)                                   # what megarl's ensure_ray does
    with pytest.raises(RuntimeError, match="Ray already runs in this process") as err:
        TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    assert "\n" not in str(err.value) and "launch_reward_fn_async=false" in str(err.value)
    assert ray.is_initialized() and ray.state["shutdowns"] == 0, "the pool's Ray is left alone"


def test_megarls_pools_share_the_jobs_node_cluster(monkeypatch, dirs):
    """The engine first: the leader's Ray is the job's node cluster, which megarl started (with its
    token) and which outlives the LLM, so a pool in this process runs there instead of refusing."""
    from megarl.parallel.actor_pool import ensure_ray
    trtllm_fake.install(monkeypatch, V29)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    ray = sys.modules["ray"]
    inits = list(ray.state["inits"])
    ensure_ray(2)
    assert ray.state["inits"] == inits and ray.get_runtime_context().namespace == "trtllm", "the same Ray"
    engine.close()
    assert ray.is_initialized() and ray.state["shutdowns"] == 0, "the pool's Ray survives the LLM"


def test_megarls_pools_refuse_the_llms_own_ray(monkeypatch, dirs):
    """TLLM_RAY_FORCE_LOCAL_CLUSTER=1: the executor's Ray (namespace trtllm, no token) dies with the
    LLM (the fake's shutdown calls ray.shutdown(), as RayExecutor.shutdown does): a pool refuses it."""
    from megarl.parallel.actor_pool import ensure_ray
    trtllm_fake.install(monkeypatch, V29)
    monkeypatch.setenv("TLLM_RAY_FORCE_LOCAL_CLUSTER", "1")
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    ray = sys.modules["ray"]
    assert ray.state["inits"][-1]["address"] == "local" and ray.get_runtime_context().namespace == "trtllm"
    with pytest.raises(RuntimeError, match="belongs to TensorRT-LLM's rollout engine") as err:
        ensure_ray(2)
    assert "\n" not in str(err.value) and "TLLM_RAY_FORCE_LOCAL_CLUSTER" in str(err.value)
    engine.close()
    assert not ray.is_initialized() and ray.state["shutdowns"] == 1


# -- the workers' environment -------------------------------------------------------------------------------
def test_ray_workers_inherit_none_of_torchruns_variables(monkeypatch, dirs):
    """RayExecutor copies os.environ into its workers, on top of the environment of the process
    that started the node's cluster: under torchrun both carry the trainer's rank, world size,
    rendezvous port and megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 unless megarl removes them."""
    tllm = trtllm_fake.install(monkeypatch, V29)
    trainer = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_PORT": "29500",
               "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    for key, value in trainer.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    env = engine.llm.worker_env
    assert not set(trainer) & set(env), sorted(set(trainer) & set(env))
    # what a worker process sees: the node cluster's environment, the env_vars above on top
    assert not set(trainer) & set(engine.llm.effective_env), sorted(set(trainer) & set(engine.llm.effective_env))
    assert env["NCCL_CUMEM_ENABLE"] == "1" and env["TLLM_DISABLE_MPI"] == "1"
    bin_dir = os.path.join(os.path.dirname(tllm.__file__), "bin")
    assert env["PATH"].split(os.pathsep)[0] == bin_dir, "TensorRT-LLM's bin directory first"
    assert {k: os.environ.get(k) for k in trainer} == trainer, "the leader's own environment is restored"
    assert "NCCL_CUMEM_ENABLE" not in os.environ and bin_dir not in os.environ.get("PATH", "")
    engine.close()


def test_an_explicit_nccl_cumem_setting_is_kept():
    env = placement.worker_environment([0], {"NCCL_CUMEM_ENABLE": "0", "PATH": "/b:/a", "TORCHELASTIC_X": "1"}, "/a")
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["PATH"] == "/a:/b" and env["TORCHELASTIC_X"] is None


# -- memory while asleep --------------------------------------------------------------------------------------
def test_sleep_releases_every_tag_and_restores_what_it_backed_up(monkeypatch, dirs):
    """Every memory tag leaves the GPU while asleep (`model`, `executor_extra`, `sampler` too, not
    only kv_cache and model_weights); only the KV cache and the weights a sync rewrites come back
    without content (NONE), the rest through a host copy."""
    trtllm_fake.install(monkeypatch, V29)
    named = state_of(dirs["model_a"])
    engine = TRTLLMEngine(dirs["a"], cfg(load_format="dummy"), device="cpu")
    engine.update_weights(named)
    engine.finalize_weights()
    greedy = SamplingParams(max_tokens=6, do_sample=False)
    ref = engine.generate([[3, 17, 42]], greedy)
    seen = []
    engine.sleep(on_release=lambda tag: seen.append((tag, engine.llm.resident)))
    assert engine.llm.resident == 0, "nothing of the engine's is left on the GPU"
    assert seen[-1][0] == "kv_cache" and {t for t, _ in seen} == set(engine.features.memory_tags)
    modes = {m.value: v for m, v in engine.llm.kwargs["sleep_config"].restore_modes.items()}
    assert modes == {"kv_cache": "NONE", "model_weights": "NONE"}, "NONE only for what the refit rewrites"
    engine.update_weights(named)
    engine.finalize_weights()
    engine.wake()
    assert torch.isfinite(dict(engine.llm.model.named_buffers())["model.rotary_emb.inv_freq"]).all()
    assert engine.generate([[3, 17, 42]], greedy) == ref
    engine.close()


# -- the torch the wheel wants ---------------------------------------------------------------------------------
def test_trtllm_check_reads_the_wheels_torch_pin(monkeypatch):
    import importlib.metadata as md

    from benchmarks import trtllm_check
    assert trtllm_check.torch_pin(["numpy<2", "torch==2.9.0", "pytest; extra == 'dev'"]) == "==2.9.0"
    assert trtllm_check.torch_pin(["numpy<2"]) is None
    real_version, real_requires = md.version, md.requires

    def requires(dist):
        if dist in ("tensorrt-llm", "tensorrt_llm"):
            return ["torch<=2.11.0a0,>=2.11.0a0"]
        return real_requires(dist)
    monkeypatch.setattr(md, "requires", requires)
    monkeypatch.setattr(md, "version", lambda dist: "2.9.1+cu128" if dist == "torch" else real_version(dist))
    got = trtllm_check.torch_versions()
    assert got == {"torch_found": "2.9.1+cu128", "torch_wanted": "<=2.11.0a0,>=2.11.0a0", "torch_matches": False}
    monkeypatch.setattr(md, "version", lambda dist: "2.11.0a0+nv" if dist == "torch" else real_version(dist))
    assert trtllm_check.torch_versions()["torch_matches"] is True


def test_the_config_refuses_megarls_ray_pools_beside_an_llms_own_ray(monkeypatch):
    """Known before any engine starts: with TLLM_RAY_FORCE_LOCAL_CLUSTER=1 the engine runs a Ray of
    the LLM's own in the rank's process (it declares owns_process_ray with that switch); without
    it the pools share the job's node cluster."""
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    trt = ["actor_rollout_ref.rollout.name=trtllm"]
    pools = ["reward_model.launch_reward_fn_async=true", "actor_rollout_ref.rollout.multi_turn.tool_backend=ray"]
    assert load_config(None, trt + pools).reward_model.launch_reward_fn_async
    monkeypatch.setenv("TLLM_RAY_FORCE_LOCAL_CLUSTER", "1")
    with pytest.raises(ConfigError, match="reward_model.launch_reward_fn_async") as err:
        load_config(None, trt + pools[:1])
    assert "\n" not in str(err.value) and "set it to false" in str(err.value)
    assert "unset that variable" in str(err.value)
    with pytest.raises(ConfigError, match="multi_turn.tool_backend.*use tool_backend=thread"):
        load_config(None, trt + pools[1:])
    assert load_config(None, pools[:1]).reward_model.launch_reward_fn_async
