"""The TensorRT-LLM API as it stands on main, against the conformance fake (tests/rollout/trtllm_fake.py).

    python -m pytest -q tests/rollout/test_trtllm_api_now.py

Sources (NVIDIA/TensorRT-LLM): tensorrt_llm/executor/params/sampling.py at 1f064c46 (SamplingParams
and LogprobMode live there; _apply_generation_config_defaults fills unset sampling fields from the
model's generation_config.json). FAKES: tensorrt_llm cannot run here.
"""
from __future__ import annotations

import pytest

from megarl.config.errors import ConfigError
from megarl.rollout.base import SamplingParams
from megarl.rollout.trtllm import TRTLLMEngine, detect_features
from megarl.rollout.trtllm.args import sampling_kwargs
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import trtllm_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = "trtllm-1.3.0rc29.json"


def test_sampling_params_come_from_where_they_live(monkeypatch, dirs):
    tllm = trtllm_fake.install(monkeypatch, V, {"sampling_module": "executor.params.sampling"})
    moved = __import__("sys").modules["tensorrt_llm.executor.params.sampling"]
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu")
    engine.generate([[3, 17, 42]], SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    sent = engine.llm.sent[-1]
    assert isinstance(sent, moved.SamplingParams) and isinstance(sent.logprobs_mode, moved.LogprobMode)
    assert tllm.SamplingParams is moved.SamplingParams


def test_every_sampling_field_is_sent_neutral_rather_than_left_to_the_model(monkeypatch):
    """None would let the model's generation_config.json sampling defaults fill the field."""
    feats = detect_features(trtllm_fake.install(monkeypatch, V))
    for sp in (SamplingParams(temperature=1.0), SamplingParams(do_sample=False)):
        kw = sampling_kwargs(sp, feats, max_tokens=4)
        assert (kw["top_k"], kw["top_p"], kw["repetition_penalty"]) == (0, 1.0, 1.0), kw


def test_generation_config_is_reserved(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V)
    cfg = trtllm_config(engine_kwargs={"trtllm": {"generation_config": "auto"}})
    with pytest.raises(ConfigError, match="generation_config is reserved") as refused:
        TRTLLMEngine(dirs["a"], cfg, device="cpu")
    assert "\n" not in str(refused.value)


def test_backend_only_where_the_llm_has_it(monkeypatch, dirs):
    fields = [f for f in trtllm_fake.load_snapshot(V)["llm_args_fields"] if f != "backend"]
    trtllm_fake.install(monkeypatch, V, {"llm_args_fields": fields})
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu")
    assert "backend" not in engine.llm.kwargs
    trtllm_fake.install(monkeypatch, V)
    assert TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu").llm.kwargs["backend"] == "pytorch"
