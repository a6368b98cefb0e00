"""What a TensorRT-LLM engine takes of its GPU: verl's gpu_memory_utilization converted to the
KV cache's fraction of free memory, CUDA graphs with padding and the MAX_UTILIZATION capacity
scheduler (verl's trtllm rollout builds both so), each replaceable through engine_kwargs.trtllm.

    python -m pytest -q tests/rollout/test_trtllm_node.py

FAKES: tensorrt_llm cannot run here, nor torch.cuda.mem_get_info (measured values stand in).
"""
from __future__ import annotations

import logging

import pytest

from megarl.config.errors import ConfigError
from megarl.rollout.trtllm import TRTLLMEngine, resources
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import trtllm_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = "trtllm-1.3.0rc29.json"
GIB = 1 << 30


def test_kv_fraction_is_what_verls_fraction_of_total_memory_leaves():
    # 80 GiB GPU, 10 in use (the trainer's), 16 of weights: 0.9 of 80 leaves 46 of the 54 free after load
    assert resources.kv_fraction(0.9, 70 * GIB, 80 * GIB, 16 * GIB) == pytest.approx(46 / 54)
    with pytest.raises(ConfigError, match="leaves no KV cache") as refused:
        resources.kv_fraction(0.3, 70 * GIB, 80 * GIB, 16 * GIB)
    assert "\n" not in str(refused.value)


def test_the_engine_converts_and_logs_the_kv_cache(monkeypatch, dirs, caplog):
    trtllm_fake.install(monkeypatch, V)
    weights = resources.checkpoint_bytes(dirs["a"])
    monkeypatch.setattr(resources, "gpu_memory", lambda device: (70 * GIB, 80 * GIB))
    with caplog.at_level(logging.INFO, logger="megarl.rollout.trtllm.engine"):
        engine = TRTLLMEngine(dirs["a"], trtllm_config(gpu_memory_utilization=0.5), device="cpu")
    want = (40 * GIB - 10 * GIB - weights) / (70 * GIB - weights)
    assert engine.llm.kwargs["kv_cache_config"].free_gpu_memory_fraction == pytest.approx(want)
    assert "free_gpu_memory_fraction=" in caplog.text and "GiB per GPU" in caplog.text


def test_cuda_graphs_and_scheduler_by_default_and_replaceable(monkeypatch, dirs):
    tllm = trtllm_fake.install(monkeypatch, V)
    args = tllm.llmapi.llm_args
    first = TRTLLMEngine(dirs["a"], trtllm_config(max_num_seqs=48), device="cpu")
    kw = first.llm.kwargs
    first.close()                            # its workers hold the GPU's bundle until then
    assert kw["cuda_graph_config"] == args.CudaGraphConfig(enable_padding=True, max_batch_size=48)
    assert kw["scheduler_config"] == args.SchedulerConfig(
        capacity_scheduler_policy=args.CapacitySchedulerPolicy.MAX_UTILIZATION)
    mine = args.CudaGraphConfig(batch_sizes=[1, 2, 4])
    cfg = trtllm_config(engine_kwargs={"trtllm": {"cuda_graph_config": mine, "scheduler_config": None}})
    kw = TRTLLMEngine(dirs["a"], cfg, device="cpu").llm.kwargs
    assert kw["cuda_graph_config"] == mine and "scheduler_config" not in kw


def test_the_checks_size_table_and_eos_ids(tmp_path):
    """benchmarks/trtllm_check.py: which dense bf16 sizes fit a GPU at a TP, and the EOS ids it
    counts stops on (config.json's and generation_config.json's)."""
    import json

    from benchmarks import trtllm_check
    fit = trtllm_check.sizes_that_fit(80 * GIB, 1, 0.85)
    assert fit["14B"] and not fit["32B"] and trtllm_check.sizes_that_fit(80 * GIB, 4, 0.85)["32B"]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert trtllm_check.model_eos(str(tmp_path)) == [2, 7]
    assert len(trtllm_check.PREFIX) >= 2 * 32 and all(p[:len(trtllm_check.PREFIX)] == trtllm_check.PREFIX
                                                      for p in trtllm_check.PROMPTS)
