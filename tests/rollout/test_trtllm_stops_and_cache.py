"""EOS with TensorRT-LLM 1.3's default sampler, and the prefix cache across sleep and refits,
against the conformance fake (tests/rollout/trtllm_fake.py; its comments name the sources).

FAKES: tensorrt_llm cannot run here (no CUDA); nothing here shows the real package behaves so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from megarl.config.errors import ConfigError
from megarl.rollout.base import SamplingParams
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import trtllm_config

V13 = "trtllm-1.3.0rc21.json"
PROMPT = [3, 17, 42, 8, 5]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


cfg = trtllm_config


def test_greedy_responses_stop_at_eos_with_the_default_sampler(monkeypatch, dirs):
    """TorchSampler (the 1.3 default) stops a greedy request only on end_id; with end_id=-1 and EOS
    only in stop_token_ids every response ran to max_tokens with finish reason "length"."""
    trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu", pad_token_id=0)
    free = engine.generate([PROMPT], SamplingParams(max_tokens=10, do_sample=False))[0][0]
    eos = free.token_ids[3]                   # a token greedy decoding reaches: the tokenizer's EOS here
    first = free.token_ids.index(eos)
    got = engine.generate([PROMPT], SamplingParams(max_tokens=10, do_sample=False, eos_token_ids=[eos]))[0][0]
    assert got.finish_reason == "stop" and got.token_ids == free.token_ids[:first + 1], got
    sent = engine.llm.sent[-1]
    assert sent.end_id == eos and sent.pad_id == 0
    engine.close()


def test_ignore_eos_keeps_going_and_extra_stop_ids_stay_stop_words(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    free = engine.generate([PROMPT], SamplingParams(max_tokens=10, do_sample=False))[0][0]
    eos = free.token_ids[3]
    got = engine.generate([PROMPT], SamplingParams(max_tokens=10, do_sample=False, eos_token_ids=[eos],
                                                   ignore_eos=True))[0][0]
    assert got.finish_reason == "length" and got.token_ids == free.token_ids
    engine.generate([PROMPT], SamplingParams(max_tokens=4, eos_token_ids=[eos, 7], stop_token_ids=[9]))
    sent = engine.llm.sent[-1]
    assert sent.end_id == eos and sent.stop_token_ids == sorted({eos, 7, 9}) and sent.pad_id == eos
    engine.close()


def test_a_sleep_without_a_refit_never_serves_stale_prefix_blocks(monkeypatch, dirs):
    """Keep-weights sleep (load_format=auto): the KV cache comes back without its content (restore
    mode NONE) but block reuse still points at it; without a prefix-cache reset on wake-up a
    prompt sharing 128+ tokens with an earlier one was decoded from garbage."""
    trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], cfg(prompt_length=160, response_length=8, enable_sleep_mode=True,
                                         free_cache_engine=True), device="cpu")
    shared = [(7 * i + 3) % 90 + 2 for i in range(140)]
    greedy = SamplingParams(max_tokens=6, do_sample=False)
    engine.generate([shared + [11]], greedy)
    before = engine.generate([shared + [12]], greedy)[0][0]       # reuses the first prompt's blocks
    engine.sleep()
    engine.wake()
    after = engine.generate([shared + [12]], greedy)[0][0]
    assert after.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(after.log_probs, before.log_probs)) < 1e-4, after.log_probs
    assert ("reset_prefix_cache", ()) in engine.llm.rpcs
    engine.close()


def _with_model_eos(src: str, dst, eos: list[int]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    with open(path, "w") as f:
        json.dump({**gen, "eos_token_id": eos}, f)
    return str(dst)


def test_the_models_generation_config_eos_ids_stop_and_ignore_eos_is_refused(monkeypatch, dirs, tmp_path):
    """SamplingParams._setup (executor/params/sampling.py at 1f064c46) adds every EOS id of the
    model's generation_config.json but end_id to the stop ids, whatever ignore_eos says: megarl
    sends them itself (the stop ids it sends are all that stop a response) and refuses ignore_eos
    in one line instead of returning responses cut short at an EOS it was told to ignore."""
    trtllm_fake.install(monkeypatch, "trtllm-1.3.0rc29.json")       # per-request seeds: calls repeat
    sp = SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    first = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    plain = first.generate([[3, 17, 42]], sp)[0][0]
    first.close()                            # its workers hold the GPU's bundle until then
    assert len(plain.token_ids) == 8
    stop = plain.token_ids[2]
    model = _with_model_eos(dirs["a"], tmp_path / "eos", [stop])
    with pytest.raises(ConfigError, match="generation_config.json eos_token_id") as refused:
        TRTLLMEngine(model, cfg(ignore_eos=True), device="cpu")
    assert "\n" not in str(refused.value)
    engine = TRTLLMEngine(model, cfg(), device="cpu")
    with pytest.raises(ConfigError, match="whatever ignore_eos says"):
        engine.generate([[3, 17, 42]], sp)
    out = engine.generate([[3, 17, 42]], dataclasses.replace(sp, ignore_eos=False))[0][0]
    assert out.token_ids == plain.token_ids[:plain.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    assert stop in engine.llm.sent[-1].stop_token_ids
