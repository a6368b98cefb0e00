"""Three rules of TensorRT-LLM's own source the engine follows (integer device ordinals for the Ray
workers, the simple log-prob format, which memory tags a sleep may discard), and how its Ray
workers import megarl, each against the conformance fake (tests/rollout/trtllm_fake.py), which
places workers, validates SamplingParams and restores memory tags as the real files named in the
snapshot's "fields" do.

FAKES: tensorrt_llm cannot run here (no CUDA); nothing here shows the real package behaves so.
"""
from __future__ import annotations

import os

import pytest
import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import conformance, trtllm_fake
from tests.rollout.fixtures import state_of, trtllm_config

V13 = "trtllm-1.3.0rc21.json"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


cfg = trtllm_config


def test_workers_start_on_integer_ordinals_under_a_launchers_visible_devices(monkeypatch, dirs):
    """The Ray executor's workers parse CUDA_VISIBLE_DEVICES and their Ray GPU id with int()
    (executor/ray/gpu_worker.py RayWorkerWrapper.__init__ / physical_to_local_id): the engine
    must hand them integer ordinals, translated through the launcher's own CUDA_VISIBLE_DEVICES."""
    trtllm_fake.install(monkeypatch, V13)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")        # e.g. Slurm's allocation
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu:1")       # this rank's GPU: physical 5
    assert engine.group_uuids == ["GPU-fake-5"]
    assert engine.llm.workers == ["GPU-fake-5"], "the TP worker runs on the rank's own GPU"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7", "the launcher's setting is restored"
    engine.close()


def test_generate_asks_the_sampled_token_only_in_the_simple_format(monkeypatch, dirs):
    """SamplingParams._validate: logprobs_simple_format=True requires logprobs == 0 (0 = the
    sampled token only); the log-probs that come back are the trainer's, exactly."""
    tllm = trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3)
    groups = engine.generate(conformance.PROMPTS, sp)
    assert conformance.Oracle(dirs["model_a"]).max_error(groups, conformance.PROMPTS, 1.0) <= conformance.TOL
    with pytest.raises(ValueError, match="requires logprobs == 0"):
        tllm.SamplingParams(logprobs=1, logprobs_simple_format=True)


def test_sleep_discards_only_the_weights(monkeypatch, dirs):
    """Only the weights (model_weights) and the KV cache may come back without their content; the
    model's other buffers (here the rotary inv_freq, which no refit rewrites) must be kept."""
    trtllm_fake.install(monkeypatch, V13)
    named = state_of(dirs["model_a"])
    engine = TRTLLMEngine(dirs["a"], cfg(load_format="dummy"), device="cpu")
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()
    greedy = SamplingParams(max_tokens=6, do_sample=False)
    ref = engine.generate([[3, 17, 42]], greedy)
    engine.sleep()
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()
    engine.wake()
    buffers = dict(engine.llm.model.named_buffers())
    assert torch.isfinite(buffers["model.rotary_emb.inv_freq"]).all(), "a non-weight buffer came back as garbage"
    assert engine.generate([[3, 17, 42]], greedy) == ref
    discarded = {m.value for m, mode in engine.llm.kwargs["sleep_config"].restore_modes.items() if mode == "NONE"}
    assert discarded <= {"kv_cache", "model_weights", "draft_model_weights"}, discarded


def test_ray_workers_import_the_extension_without_a_pip_install(monkeypatch, dirs):
    """The Ray executor copies the leader's environment into its workers; megarl is not installed
    there (FakeCluster.installed is empty), so the workers import it through PYTHONPATH."""
    trtllm_fake.install(monkeypatch, V13)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    engine = TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    assert engine.llm.workers == ["GPU-fake-0"]
    assert "PYTHONPATH" not in os.environ, "restored after start-up"
    engine.close()


def test_a_worker_that_cannot_import_the_extension_stops_start_up_in_one_line(monkeypatch, dirs, tmp_path):
    """Where the workers cannot import megarl (here: the root megarl puts on their PYTHONPATH has no
    megarl, as on another node of an existing Ray cluster), start-up says what to do in one line."""
    from megarl.rollout.trtllm import placement
    trtllm_fake.install(monkeypatch, V13)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(placement, "megarl_root", lambda: str(tmp_path))
    with pytest.raises(RuntimeError, match="import megarl.rollout.trtllm.placement.DeviceReportingExtension") as err:
        TRTLLMEngine(dirs["a"], cfg(), device="cpu")
    assert "pip install -e" in str(err.value) and "\n" not in str(err.value)
