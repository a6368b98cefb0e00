"""Routing replay (R3) and seeds with TensorRT-LLM, against the conformance fake
(tests/rollout/trtllm_fake*.py; the snapshots name each field's source).

FAKES: tensorrt_llm cannot run here (no CUDA); nothing here shows the real package behaves so.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.base import SamplingParams, pack_completions
from megarl.rollout.trtllm import TRTLLMEngine, detect_features
from tests.rollout import trtllm_fake, trtllm_fake_llm
from tests.rollout.fixtures import trtllm_config
from tests.rollout.trtllm_fake_sampling import routes_for

V21, V29 = "trtllm-1.3.0rc21.json", "trtllm-1.3.0rc29.json"
PROMPTS = [[3, 17, 42, 8], [5, 6]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


cfg = trtllm_config


# -- routing replay ---------------------------------------------------------------------------------
def test_r3_returns_the_routed_experts_where_the_classes_have_them(monkeypatch, dirs):
    """rc29's classes carry the three pieces: the engine asks for them and every completion carries
    [prompt + fed tokens, MoE layers, top-k] ids, which pack into the batch's routed_experts, so
    R3 with rollout.name=trtllm has routes to replay."""
    trtllm_fake.install(monkeypatch, V29)
    engine = TRTLLMEngine(dirs["a"], cfg(enable_rollout_routing_replay=True), device="cpu")
    assert engine.llm.kwargs["enable_return_routed_experts"] is True
    groups = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=1))
    assert all(sp.return_routed_experts for sp in engine.llm.sent)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            fed = prompt + c.token_ids[:-1]
            assert isinstance(c.routed_experts, torch.Tensor), "numpy from TensorRT-LLM becomes a tensor"
            assert c.routed_experts.shape == (len(fed), *trtllm_fake_llm.ROUTE_SHAPE[:2])
            assert torch.equal(c.routed_experts, routes_for(fed, *trtllm_fake_llm.ROUTE_SHAPE))
    batch = DataProto(non_tensor_batch={"prompt_token_ids": np.array(PROMPTS, dtype=object)})
    packed = pack_completions(batch, groups, pad_token_id=0)
    assert packed.batch["routed_experts"].shape[:2] == packed.batch["input_ids"].shape
    engine.close()


def test_r3_is_accepted_by_the_config_for_trtllm():
    from megarl.experiment import load_config
    r3 = ["actor_rollout_ref.actor.router_replay.mode=R3",
          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "actor_rollout_ref.rollout.name=trtllm"]
    assert load_config(None, r3).rollout.enable_rollout_routing_replay


def test_r3_is_refused_in_one_line_where_the_classes_lack_them(monkeypatch, dirs):
    tllm = trtllm_fake.install(monkeypatch, V21)
    assert detect_features(tllm).routes_missing() == ["LLM(enable_return_routed_experts)",
                                                      "SamplingParams.return_routed_experts",
                                                      "CompletionOutput.routed_experts"]
    with pytest.raises(ConfigError, match=r"1\.3\.0rc21 has no LLM\(enable_return_routed_experts\)") as err:
        TRTLLMEngine(dirs["a"], cfg(enable_rollout_routing_replay=True), device="cpu")
    assert "\n" not in str(err.value) and "rollout.name=native" in str(err.value)


def test_the_fake_pairs_the_request_flag_with_the_llms(monkeypatch, dirs):
    """LLM._check_arguments (1.3.0rc28): a request's return_routed_experts needs the LLM's switch."""
    tllm = trtllm_fake.install(monkeypatch, V29)
    llm = tllm.LLM(model=dirs["a"])
    with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
        llm.generate([[3, 4]], tllm.SamplingParams(max_tokens=2, return_routed_experts=True))
    out = llm.generate([[3, 4]], tllm.SamplingParams(max_tokens=2))[0].outputs[0]
    assert out.routed_experts is None, "nothing unless asked"


# -- seeds ---------------------------------------------------------------------------------------------
def test_equal_prompts_of_one_call_draw_different_samples(monkeypatch, dirs):
    """After PR #17172 each request's generator is seeded from its own seed: one seed for every
    prompt gave equal prompts equal samples (a GRPO group of copies collapsed to one sample).
    megarl gives every prompt its own seed; the call as a whole still repeats."""
    trtllm_fake.install(monkeypatch, V29)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    first = engine.generate([PROMPTS[0], PROMPTS[0]], sp)
    assert first[0][0].token_ids != first[1][0].token_ids
    assert engine.generate([PROMPTS[0], PROMPTS[0]], sp) == first, "the same seed repeats the call"
    seeds = [p.seed for p in engine.llm.sent[:2]]
    assert len(set(seeds)) == 2 and all(0 < s < 2**63 for s in seeds)
    engine.close()


def test_before_pr_17172_the_seed_is_ignored(monkeypatch, dirs):
    """rc21's TorchSampler draws every request from one generator: the same seed does not repeat
    (what benchmarks/trtllm_check.py reports as seed_repeats=False instead of failing)."""
    trtllm_fake.install(monkeypatch, V21)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    assert engine.generate([PROMPTS[0]], sp) != engine.generate([PROMPTS[0]], sp)
    engine.close()
