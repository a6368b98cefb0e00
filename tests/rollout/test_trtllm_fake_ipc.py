"""The fake's bucket decoding is the worker extension's (tests/rollout/trtllm_fake_ipc.py names
the source): a restricted unpickler, the device argument rewritten to the worker's GPU, and every
TP worker opening its own handles. FAKES: tensorrt_llm cannot run here.

    python -m pytest -q tests/rollout/test_trtllm_fake_ipc.py
"""
from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from megarl.rollout.trtllm import bucket_handles
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import save_model, state_of

V = "trtllm-1.3.0rc29.json"


@pytest.fixture
def llm2(monkeypatch, tmp_path):
    tllm = trtllm_fake.install(monkeypatch, V)
    model = save_model(str(tmp_path))
    return tllm.LLM(model=str(tmp_path), tensor_parallel_size=2), state_of(model)


def test_megarls_handles_pass_the_restricted_unpickler_and_every_worker_opens_its_own(llm2):
    llm, named = llm2
    new = [(n, t + 1) for n, t in named]
    handles = {**bucket_handles(new, llm.workers[0]), **bucket_handles(new, llm.workers[1])}
    llm._collective_rpc("update_weights", (handles,))
    got = dict(llm.model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in new)


def test_a_worker_whose_own_handles_differ_is_caught(llm2):
    llm, named = llm2
    handles = {**bucket_handles(named, llm.workers[0]),
               **bucket_handles([(n, t * 2) for n, t in named], llm.workers[1])}
    with pytest.raises(RuntimeError, match="TP worker 1 received other tensors"):
        llm._collective_rpc("update_weights", (handles,))


@pytest.mark.parametrize("payload", [
    [("w", (os.getcwd, ()))],                                   # a global outside builtins and torch.*
    [("w", torch.zeros(2).untyped_storage())],                  # pickled through torch.storage._load_from_bytes
])
def test_the_decoder_refuses_what_the_workers_refuse(llm2, payload):
    llm, _ = llm2
    blob = base64.b64encode(pickle.dumps(payload)).decode()
    with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
        llm._collective_rpc("update_weights", ({u: blob for u in llm.workers},))


class Clashing:
    """An extension redefining a method of TensorRT-LLM's worker class."""

    def sleep(self, tags):
        return None


def test_an_extension_that_redefines_a_worker_attribute_is_refused(monkeypatch, tmp_path):
    """RayWorkerWrapper._inject_worker_extension (executor/ray/gpu_worker.py at 00be09f7): a
    ValueError for any extension attribute the worker class already has; megarl's passes."""
    tllm = trtllm_fake.install(monkeypatch, V)
    save_model(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with pytest.raises(ValueError, match="already defines 'sleep', which conflicts with extension Clashing"):
        tllm.LLM(model=str(tmp_path), ray_worker_extension_cls=f"{__name__}.Clashing")
    from megarl.rollout.trtllm.placement import EXTENSION
    assert tllm.LLM(model=str(tmp_path), ray_worker_extension_cls=EXTENSION).workers
