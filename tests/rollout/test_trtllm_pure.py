"""The TensorRT-LLM engine's pure parts, on CPU.

FAKES: tensorrt_llm cannot be installed here (no CUDA; its wheel comes from NVIDIA's index), so
these tests use stand-ins, named Fake*, for its result objects (CompletionOutput, Logprob),
KvCacheConfig and, in the last test, a whole fake `tensorrt_llm` module whose LLM records the
calls it gets. They check megarl's side of the API (arguments built, the sampled token's
log-prob read, the update/finalize/sleep call sequence); they do not show that TensorRT-LLM
itself behaves so. The real engine runs through tests/rollout/test_conformance.py wherever
tensorrt_llm imports.
"""
from __future__ import annotations

import base64
import pickle
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.trtllm import (SLEEP_TAGS, TRTLLMEngine, bucket_handles, checkpoint_names,
                                   completion_from_output, llm_kwargs, logprob_mode, sampling_kwargs)
from tests.rollout.fixtures import save_model, state_of


@dataclass
class FakeKvCacheConfig:
    free_gpu_memory_fraction: float
    enable_block_reuse: bool


@dataclass
class FakeLogprob:
    logprob: float
    rank: int


@dataclass
class FakeCompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str = "length"
    generation_logits: torch.Tensor | None = None


@dataclass
class FakeRequestOutput:
    outputs: list = field(default_factory=list)


def test_llm_kwargs_from_config_and_verbatim_engine_kwargs():
    cfg = RolloutConfig(tensor_model_parallel_size=2, prompt_length=100, response_length=28, max_num_seqs=64,
                        gpu_memory_utilization=0.6, enable_prefix_caching=False,
                        engine_kwargs={"trtllm": {"max_num_tokens": 4096, "enable_sleep": None,
                                                  "cuda_graph_config": {"enable_padding": True}}})
    kw = llm_kwargs(cfg, "/models/q", FakeKvCacheConfig)
    assert kw["model"] == "/models/q" and kw["backend"] == "pytorch" and kw["tensor_parallel_size"] == 2
    assert kw["max_seq_len"] == 128 and kw["max_input_len"] == 100 and kw["max_batch_size"] == 64
    assert kw["load_format"] == "dummy" and kw["orchestrator_type"] == "ray"
    assert kw["ray_worker_extension_cls"] == "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
    assert kw["kv_cache_config"] == FakeKvCacheConfig(0.6, False)
    assert kw["max_num_tokens"] == 4096, "engine_kwargs.trtllm wins, verbatim"
    assert kw["cuda_graph_config"] == {"enable_padding": True}
    assert "enable_sleep" not in kw, "a null in engine_kwargs removes megarl's key"
    assert llm_kwargs(RolloutConfig(load_format="auto"), "/m", FakeKvCacheConfig)["load_format"] == "auto"


@pytest.mark.parametrize("sp, mode", [
    (SamplingParams(do_sample=False, temperature=0.7, top_k=5), "raw"),      # greedy: T=1 by convention
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=20), "raw"),           # T=1: raw == ours
    (SamplingParams(temperature=0.7), "processed"),                          # only temperature applies
    (SamplingParams(temperature=0.7, top_p=0.9), "logits"),                  # processed would renormalise
    (SamplingParams(temperature=0.7, repetition_penalty=1.2), "logits"),
])
def test_logprob_mode_matches_the_trainer(sp, mode):
    assert logprob_mode(sp) == mode


def test_sampling_kwargs():
    kw = sampling_kwargs(SamplingParams(n=4, max_tokens=32, temperature=0.7, seed=5, stop_token_ids=[9],
                                        eos_token_ids=[2]), pad_token_id=0)
    assert kw["n"] == 4 and kw["max_tokens"] == 32 and kw["temperature"] == 0.7 and kw["seed"] == 5
    assert kw["stop_token_ids"] == [2, 9] and kw["end_id"] == -1 and kw["include_stop_str_in_output"]
    assert kw["logprobs"] == 1 and kw["logprobs_mode"] == "processed" and not kw["return_generation_logits"]
    assert "top_k" not in kw and "top_p" not in kw and "repetition_penalty" not in kw
    kw = sampling_kwargs(SamplingParams(do_sample=False, eos_token_ids=[2], ignore_eos=True))
    assert kw["temperature"] == 0.0 and "stop_token_ids" not in kw and kw["logprobs_mode"] == "raw"
    kw = sampling_kwargs(SamplingParams(temperature=0.5, top_k=10, top_p=0.8))
    assert kw["top_k"] == 10 and kw["top_p"] == 0.8 and kw["return_generation_logits"]


def test_the_sampled_tokens_log_prob_is_read_not_the_first_entry():
    # At position 1 the sampled token (7) is not the top-1 (3): the dict's first entry is 3's.
    out = FakeCompletionOutput(token_ids=[5, 7], finish_reason="stop", logprobs=[
        {5: FakeLogprob(-0.2, 1)},
        {3: FakeLogprob(-0.1, 1), 7: FakeLogprob(-2.5, 4)}])
    c = completion_from_output(out, SamplingParams(temperature=1.0))
    assert c.token_ids == [5, 7] and c.log_probs == [-0.2, -2.5] and c.finish_reason == "stop"
    flat = FakeCompletionOutput(token_ids=[5, 7], logprobs=[-0.2, -2.5])      # list[float] format
    assert completion_from_output(flat, SamplingParams()).log_probs == [-0.2, -2.5]
    missing = FakeCompletionOutput(token_ids=[5, 7], logprobs=[{5: FakeLogprob(-0.2, 1)}, {3: FakeLogprob(-0.1, 1)}])
    with pytest.raises(RuntimeError, match="lack the sampled token 7"):
        completion_from_output(missing, SamplingParams())
    with pytest.raises(RuntimeError, match="1 log-prob entries for 2 tokens"):
        completion_from_output(FakeCompletionOutput([5, 7], [{5: FakeLogprob(-0.2, 1)}]), SamplingParams())
    assert completion_from_output(FakeCompletionOutput([1], [-1.0], "cancelled"), SamplingParams()).finish_reason \
        == "abort"


def test_logits_mode_computes_the_convention_from_generation_logits():
    logits = torch.randn(3, 11)
    sp = SamplingParams(temperature=0.6, top_p=0.9)
    c = completion_from_output(FakeCompletionOutput([4, 0, 10], [], generation_logits=logits), sp)
    ref = torch.log_softmax(logits / 0.6, -1)[torch.arange(3), torch.tensor([4, 0, 10])]
    assert torch.allclose(torch.tensor(c.log_probs), ref)


def test_bucket_handles_carry_names_and_rebuild(tmp_path):
    named = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(2, 3))]
    handles = bucket_handles(named, "GPU-fake-uuid")
    assert list(handles) == ["GPU-fake-uuid"]
    decoded = pickle.loads(base64.b64decode(handles["GPU-fake-uuid"]))
    assert [n for n, _ in decoded] == ["model.norm.weight", "lm_head.weight"]
    for (name, (rebuild, args)), (_, original) in zip(decoded, named):
        assert torch.equal(rebuild(*args), original)      # CPU handles rebuild in-process
    save_model(str(tmp_path), seed=0)
    assert set(checkpoint_names(str(tmp_path))) == {n for n, _ in state_of(save_model(str(tmp_path), seed=0))}


class FakeLLM:
    """Stands in for tensorrt_llm.LLM: records kwargs and RPCs, answers generate() with a fixed
    pattern whose dicts put a non-sampled token first."""
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.rpcs, self.loaded = kwargs, [], []
        FakeLLM.instances.append(self)

    def _collective_rpc(self, method, args):
        self.rpcs.append((method, args[0] if args[0] is None or method != "update_weights" else "handles"))
        if method == "update_weights" and args[0] is not None:
            for blob in args[0].values():
                self.loaded += [n for n, _ in pickle.loads(base64.b64decode(blob))]

    def generate(self, prompts, params):
        outs = []
        for p in prompts:
            comps = []
            for j in range(params.kwargs["n"]):
                toks = [(p[-1] + j + k) % 90 + 1 for k in range(params.kwargs["max_tokens"])]
                lps = [{0: FakeLogprob(-0.01, 1), t: FakeLogprob(-t / 100, 2)} for t in toks]
                comps.append(FakeCompletionOutput(toks, lps, "length"))
            outs.append(FakeRequestOutput(comps))
        return outs


@pytest.fixture
def fake_tensorrt_llm(monkeypatch):
    mod = types.ModuleType("tensorrt_llm")
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(kwargs=kw)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = FakeKvCacheConfig
    utils = types.ModuleType("tensorrt_llm._torch.utils")
    utils.get_device_uuid = lambda index: f"GPU-fake-{index}"
    for name, m in {"tensorrt_llm": mod, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm._torch": types.ModuleType("x"),
                    "tensorrt_llm._torch.utils": utils}.items():
        monkeypatch.setitem(sys.modules, name, m)
    FakeLLM.instances.clear()
    return FakeLLM


def test_engine_call_sequence_against_a_fake_llm(tmp_path, fake_tensorrt_llm):
    model = save_model(str(tmp_path), seed=0)
    cfg = RolloutConfig(name="trtllm", prompt_length=16, response_length=8,
                        engine_kwargs={"trtllm": {"max_num_tokens": 512}})
    engine = TRTLLMEngine(str(tmp_path), cfg, device="cpu")
    llm = fake_tensorrt_llm.instances[0]
    assert llm.kwargs["max_num_tokens"] == 512 and llm.kwargs["model"] == str(tmp_path)
    with pytest.raises(RuntimeError, match="no weights yet"):
        engine.generate([[1, 2]], SamplingParams())
    named = state_of(model)
    engine.update_weights(named[:5])
    engine.update_weights(named[5:-1])
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.finalize_weights()
    assert ("update_weights", None) not in llm.rpcs, "an incomplete sync must not be finalised"
    llm.loaded.clear()
    engine.update_weights(named[:10])                     # a refused sync is redone in full
    engine.update_weights(named[10:])
    engine.finalize_weights()
    assert llm.rpcs[-1] == ("update_weights", None) and sorted(llm.loaded) == sorted(n for n, _ in named)
    groups = engine.generate([[1, 2], [30]], SamplingParams(n=2, max_tokens=3))
    assert groups[1][0].token_ids == [31, 32, 33]
    assert groups[1][0].log_probs == [-0.31, -0.32, -0.33], "the sampled token's entry, not the dict's first"
    engine.sleep()
    engine.wake()
    assert llm.rpcs[-2:] == [("sleep", SLEEP_TAGS), ("wakeup", SLEEP_TAGS)]
