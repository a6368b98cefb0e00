"""A weight sync that fails inside TensorRT-LLM leaves no engine generating on a half-written model.

    python -m pytest -q tests/rollout/test_trtllm_failed_sync.py

TensorRT-LLM's WorkerExtension.update_weights (tensorrt_llm/llmapi/rlhf_utils.py at 04762f3b, and
main) runs every module's pre_reload_weights on a sync's first bucket, re-registering parameters
as uninitialized storage: from then on only a full sync makes the model whole. Main adds
abort_update_weights, to be broadcast to every worker after a failure, and refuses to finalize a
torn cycle. FAKES (tests/rollout/trtllm_fake.py): tensorrt_llm cannot run here.
"""
from __future__ import annotations

import pytest

from megarl.checkpoint_engine.base import conclude
from megarl.checkpoint_engine.errors import WeightSyncError
from megarl.rollout.base import SamplingParams
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import state_of, trtllm_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V13 = "trtllm-1.3.0rc29.json"
GREEDY = SamplingParams(max_tokens=4, do_sample=False)


def failed_sync(engine, named, bad_bucket: int):
    """A two-bucket sync whose bucket `bad_bucket` also names a parameter the model lacks, ended
    as every transport ends one (checkpoint_engine/base.py conclude)."""
    buckets = [named[:6], named[6:]]
    buckets[bad_bucket] = buckets[bad_bucket] + [("model.layers.9.mlp.up_proj.weight", named[0][1])]
    error = None
    try:
        for bucket in buckets:
            engine.update_weights(bucket)
    except Exception as err:  # noqa: BLE001 - handed to conclude as a transport does
        error = err
    assert error is not None
    with pytest.raises(WeightSyncError) as raised:
        conclude(engine, error, [])
    return str(raised.value)


@pytest.mark.parametrize("overrides", [None, trtllm_fake.ABORTABLE], ids=["latched", "abortable"])
@pytest.mark.parametrize("bad_bucket", [0, 1])
def test_a_failed_sync_refuses_generation_until_a_full_sync(monkeypatch, dirs, overrides, bad_bucket):
    trtllm_fake.install(monkeypatch, V13, overrides)
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu")
    named = state_of(dirs["model_b"])
    message = failed_sync(engine, named, bad_bucket)
    assert "refuses to generate until a full sync succeeds" in message
    assert "keeps its old weights" not in message, message
    with pytest.raises(RuntimeError, match="did not receive a complete weight update") as refused:
        engine.generate([[3, 17, 42]], GREEDY)
    assert "\n" not in str(refused.value)
    aborts = [m for m, _ in engine.llm.rpcs if m == "abort_update_weights"]
    assert len(aborts) == (1 if overrides else 0), engine.llm.rpcs   # one RPC reaches every worker
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()
    assert engine.generate([[3, 17, 42]], GREEDY)[0][0].token_ids


def test_a_sync_that_fails_before_any_bucket_keeps_the_old_weights(monkeypatch, dirs):
    """Another rank failed before this engine sent anything: nothing was rewritten."""
    trtllm_fake.install(monkeypatch, V13, trtllm_fake.ABORTABLE)
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu")
    before = engine.generate([[3, 17, 42]], GREEDY)
    with pytest.raises(WeightSyncError):
        conclude(engine, RuntimeError("the trainer ran out of memory"), [])
    assert engine.generate([[3, 17, 42]], GREEDY) == before
    assert "abort_update_weights" not in [m for m, _ in engine.llm.rpcs]


def test_a_torn_cycle_is_not_finalized(monkeypatch, dirs):
    """Finalize after a bucket that never arrived: megarl refuses before TensorRT-LLM would."""
    trtllm_fake.install(monkeypatch, V13, trtllm_fake.ABORTABLE)
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu")
    named = state_of(dirs["model_b"])
    engine.update_weights(named[:6])
    with pytest.raises(ValueError, match="21 of 27 tensors never arrived"):
        conclude(engine, None, [])
    with pytest.raises(RuntimeError, match="did not receive a complete weight update"):
        engine.generate([[3, 17, 42]], GREEDY)
    assert ("update_weights", (None,)) not in engine.llm.rpcs
    assert [m for m, _ in engine.llm.rpcs][-1] == "abort_update_weights"
    assert not engine.llm.reload_latch


def test_the_failure_message_is_the_engine_classs_declaration():
    """In-place engines keep their old weights until a bucket lands; TensorRT-LLM never does."""
    from megarl.checkpoint_engine.base import after_failure
    from megarl.rollout.hf import HFEngine
    assert after_failure(None).startswith("keeps its old weights")
    assert HFEngine.keeps_weights_on_failed_sync and not TRTLLMEngine.keeps_weights_on_failed_sync
