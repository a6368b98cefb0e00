"""EOS with TensorRT-LLM 1.3's default sampler, and the prefix cache across sleep and refits,
against the conformance fake (tests/rollout/trtllm_fake.py; its comments name the sources).

FAKES: tensorrt_llm cannot run here (no CUDA); nothing here shows the real package behaves so.
"""
from __future__ import annotations

import pytest

from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import model_dirs

V13 = "trtllm-1.3.0rc21.json"
PROMPT = [3, 17, 42, 8, 5]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return model_dirs(str(tmp_path_factory.mktemp("trtllm_stop_models")))


def cfg(**kw) -> RolloutConfig:
    return RolloutConfig(**{"name": "trtllm", "load_format": "auto", "prompt_length": 16, "response_length": 12, **kw})


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
