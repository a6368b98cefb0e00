"""TensorRT-LLM's LLM arguments on the 1.3 line, and its 1.4-line memory API, against the
conformance fake (tests/rollout/trtllm_fake.py).

    python -m pytest -q tests/rollout/test_trtllm_memory_api.py

Sources (NVIDIA/TensorRT-LLM): tensorrt_llm/llmapi/llm_args.py at 1f064c46 (BaseLlmArgs and
TorchLlmArgs, extra="forbid": the argument list in trtllm-1.3.0rc29.json) and llmapi/llm.py at the
same commit (_validate_args_for_torch_backend refuses what that list lacks); the Runtime Memory
Checkpointing docs page (LLM.release / resume, no version named) and verl's and NeMo-RL's calls of
them (docs/trtllm.md, Sleep). FAKES: tensorrt_llm cannot run here.
"""
from __future__ import annotations

import pytest

from megarl.rollout.base import SamplingParams
from megarl.rollout.config import MultiTurnConfig
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import state_of, trtllm_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = "trtllm-1.3.0rc29.json"
GREEDY = SamplingParams(max_tokens=6, do_sample=False)


def test_an_argument_the_1_3_list_lacks_is_refused(monkeypatch, dirs):
    """disable_flashinfer_sampling and KvCacheConfig.onboard_blocks are in the 1.2 line's lists and
    gone from main's at 1f064c46: the LLM refuses the first as _TorchLLM does, the config the second
    as pydantic does."""
    tllm = trtllm_fake.install(monkeypatch, V)
    with pytest.raises(ValueError, match=r"not supported by the PyTorch backend: \['disable_flashinfer_sampling'\]"):
        tllm.LLM(model=dirs["a"], disable_flashinfer_sampling=True)
    with pytest.raises(ValueError, match="onboard_blocks\n  Extra inputs are not permitted"):
        tllm.llmapi.KvCacheConfig(onboard_blocks=True)


@pytest.mark.parametrize("kw", [{}, {"load_format": "dummy", "enable_sleep_mode": True},
                                {"enable_rollout_routing_replay": True, "enable_prefix_caching": False},
                                {"multi_turn": MultiTurnConfig(enable=True), "enable_chunked_prefill": True}])
def test_every_argument_megarl_sends_is_in_the_list(monkeypatch, dirs, kw):
    trtllm_fake.install(monkeypatch, V)
    engine = TRTLLMEngine(dirs["a"], trtllm_config(**kw), device="cpu")
    listed = set(trtllm_fake.load_snapshot(V)["llm_args_fields"])
    assert set(engine.llm.kwargs) <= listed, sorted(set(engine.llm.kwargs) - listed)
    assert set(engine.llm.args.model_fields_set) <= listed
    engine.close()


def _cycle(engine, named) -> list:
    """Sync, generate, sleep, sync while asleep, wake, generate: the two generations' tokens."""
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()
    before = engine.generate([[3, 17, 42]], GREEDY)
    engine.sleep()
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()
    engine.wake()
    return [before, engine.generate([[3, 17, 42]], GREEDY)]


def test_the_1_4_llm_releases_and_resumes_through_its_public_api(monkeypatch, dirs):
    """Where the installed LLM class has release/resume, sleep() and wake() (and a sync while
    asleep) use them, and never the workers' private sleep/wakeup RPC; wait_for_engine_idle runs
    before the release and before a sync's first bucket."""
    trtllm_fake.install(monkeypatch, V, trtllm_fake.MEMORY_API)
    engine = TRTLLMEngine(dirs["a"], trtllm_config(load_format="dummy"), device="cpu")
    assert engine.features.memory_api and engine.features.waits_for_idle
    before, after = _cycle(engine, state_of(dirs["model_a"]))
    assert after == before
    calls = [m for m, _ in engine.llm.rpcs]
    assert "sleep" not in calls and "wakeup" not in calls, calls
    assert calls.count("LLM.release") == 1 and calls.count("LLM.resume") == 2, calls
    released = next(tags for m, tags in engine.llm.rpcs if m == "LLM.release")
    assert set(released) == set(engine.features.memory_tags)
    first_release, first_bucket = calls.index("LLM.release"), calls.index("update_weights")
    assert calls[first_release - 1] == "wait_for_engine_idle"
    assert calls[first_bucket - 1] == "wait_for_engine_idle"
    second_sync = calls.index("update_weights", first_release)
    assert "wait_for_engine_idle" in calls[first_release + 1:second_sync], "the sync while asleep waits too"
    assert engine.llm.get_memory_status().state == "running"
    engine.close()


def test_without_the_public_api_the_workers_sleep_rpc_is_used(monkeypatch, dirs):
    """1.3's LLM has no release/resume and its workers no wait_for_engine_idle: the private RPCs,
    and no call the workers would refuse."""
    tllm = trtllm_fake.install(monkeypatch, V)
    assert not hasattr(tllm.LLM, "release")
    engine = TRTLLMEngine(dirs["a"], trtllm_config(load_format="dummy"), device="cpu")
    assert not engine.features.memory_api and not engine.features.waits_for_idle
    before, after = _cycle(engine, state_of(dirs["model_a"]))
    assert after == before
    calls = [m for m, _ in engine.llm.rpcs]
    assert calls.count("sleep") == 1 and calls.count("wakeup") == 2, calls
    assert not any(m.startswith("LLM.") or m == "wait_for_engine_idle" for m in calls), calls
    engine.close()


def test_the_public_api_is_detected_from_the_class_not_the_version(monkeypatch, dirs):
    """A build that calls itself 1.4 without the methods keeps the RPC path; a 1.3 build with them
    uses them."""
    from megarl.rollout.trtllm import detect_features
    assert not detect_features(trtllm_fake.install(monkeypatch, V, {"version": "1.4.0rc4"})).memory_api
    assert detect_features(trtllm_fake.install(monkeypatch, V, {**trtllm_fake.MEMORY_API,
                                                                 "version": "1.3.0rc29"})).memory_api
