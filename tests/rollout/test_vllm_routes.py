"""R3 with rollout.name=vllm, without vLLM: which layers are MoE, vLLM's layout to megarl's, the
per-device arguments, and the CPU recorder's filing of rows (tests/rollout/vllm_checks.py runs it
on real vLLM against transformers' routers and megatron's replay).

    python -m pytest -q tests/rollout/test_vllm_routes.py
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.rollout.config import RolloutConfig
from megarl.rollout.vllm.args import routes_kwargs
from megarl.rollout.vllm.routes import RouteRecorder, fed, index, moe_layers, to_megarl


def test_moe_layers_follow_each_familys_rule():
    assert moe_layers({"num_hidden_layers": 3, "num_experts": 4}) == [0, 1, 2]
    assert moe_layers({"num_hidden_layers": 4, "num_experts": 4, "mlp_only_layers": [1]}) == [0, 2, 3]
    assert moe_layers({"num_hidden_layers": 4, "num_experts": 4, "decoder_sparse_step": 2}) == [1, 3]
    assert moe_layers({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 1}) == [1, 2, 3]
    assert moe_layers({"num_hidden_layers": 2, "num_local_experts": 8}) == [0, 1]        # Mixtral
    assert moe_layers({"num_hidden_layers": 2}) == []


def test_vllm_layout_becomes_megarls_moe_layers():
    """vLLM's layer axis covers every decoder layer; megarl's holds the MoE ones, in order."""
    raw = np.zeros((5, 4, 2), dtype=np.uint8)
    raw[:, 1], raw[:, 3] = 2, 3                          # dense layers 0 and 2 stay 0 in vLLM's array
    got = to_megarl(raw, [1, 3], experts=4, fed=5)
    assert got.dtype == torch.uint8 and got.shape == (5, 2, 2)
    assert (got[:, 0] == 2).all() and (got[:, 1] == 3).all()
    wide = to_megarl(np.full((2, 1, 2), 300, dtype=np.uint16), [0], experts=512, fed=2)
    assert wide.dtype == torch.int16 and (wide == 300).all()


@pytest.mark.parametrize("raw,fed_len,match", [
    (None, 3, "no routed_experts.*MoE"),
    (np.zeros((4, 2, 2), np.uint8), 3, "covers 4 positions, the sequence fed 3"),
    (np.zeros((3, 2), np.uint8), 3, "shape"),
    (np.full((3, 2, 2), 9, np.uint8), 3, "outside 0..3"),
])
def test_routes_that_cannot_be_placed_are_refused(raw, fed_len, match):
    with pytest.raises(RuntimeError, match=match):
        to_megarl(raw, [0, 1], experts=4, fed=fed_len)


def test_arguments_per_device():
    """CUDA: vLLM's own routes, which need prefix caching; CPU: megarl's recorder, which needs every
    position computed, so prefix caching is off."""
    on = RolloutConfig(name="vllm", enable_rollout_routing_replay=True)
    assert routes_kwargs(on, "cuda") == {"enable_return_routed_experts": True}
    assert routes_kwargs(on, "cpu") == {"enable_prefix_caching": False}
    assert routes_kwargs(RolloutConfig(name="vllm"), "cuda") == {}
    with pytest.raises(ConfigError, match=r"enable_prefix_caching: =false with enable_rollout_routing_replay=true.*"
                                          r"set enable_prefix_caching=true") as err:
        routes_kwargs(RolloutConfig(name="vllm", enable_rollout_routing_replay=True, enable_prefix_caching=False),
                      "cuda")
    assert "\n" not in str(err.value)


def test_r3_with_vllm_passes_the_config():
    """vllm declares records_routes: R3's flag is accepted where it was refused."""
    assert RolloutConfig(name="vllm", enable_rollout_routing_replay=True).enable_rollout_routing_replay


class _Step:
    """Drives a RouteRecorder as vLLM's V1 runner does: execute_model's scheduler output, then the
    model's forward (flattened rows in input_batch order) with each MoE layer's capture."""

    def __init__(self, rec: RouteRecorder):
        self.rec = rec

    def __call__(self, rows: list[tuple[str, int, list[int]]], layer_ids=(0, 1)) -> None:
        runner = self.rec.runner
        runner.input_batch.req_ids = [rid for rid, _, _ in rows]
        self.rec.sched = SimpleNamespace(total_num_scheduled_tokens=sum(len(t) for _, _, t in rows),
                                         num_scheduled_tokens={rid: len(t) for rid, _, t in rows})
        ids = torch.tensor([t for _, _, toks in rows for t in toks])
        pos = torch.tensor([start + j for _, start, toks in rows for j in range(len(toks))])
        self.rec.before_forward(None, (), {"input_ids": ids, "positions": pos})
        for layer in layer_ids:                           # expert ids that encode token and layer
            self.rec.capture(layer, torch.stack([(ids + layer) % 4, (ids + layer + 1) % 4], 1))
        self.rec.after_forward(None, (), {}, None)


def _want(tokens: list[int]) -> np.ndarray:
    t = np.array(tokens)
    return np.stack([np.stack([(t + k) % 4, (t + k + 1) % 4], 1) for k in (0, 1)], 1)


def test_recorder_files_rows_under_their_requests_across_chunks_and_decodes():
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[]))
    rec = RouteRecorder(runner, layers=2, topk=2, moe=[0, 1])
    step = _Step(rec)
    rec.before_forward(None, (), {"input_ids": torch.zeros(4), "positions": torch.arange(4)})   # a profile run
    step([("a", 0, [5, 6, 7]), ("b", 0, [10, 11])])       # a's prompt in two chunks
    step([("b", 2, [12]), ("a", 3, [8, 9])])             # b decodes; batch order changed
    step([("a", 5, [13]), ("b", 3, [14])])
    got = rec.take()
    assert sorted(got) == ["a", "b"] and rec.take() == {}
    assert got["a"][0] == [5, 6, 7, 8, 9, 13] and got["b"][0] == [10, 11, 12, 14]
    for rid in "ab":
        np.testing.assert_array_equal(got[rid][1], _want(got[rid][0]))
    lookup = index(got)
    assert lookup[fed([10, 11], [12, 14, 99])] is got["b"][1]      # the last sampled token is never fed
    assert fed([10, 11], [12, 14, 99]) not in {tuple(got["a"][0])}


def test_recorder_drops_a_request_with_positions_never_computed():
    """A prefix served from a cache never runs through the routers: such a record is incomplete and
    dropped, so the engine reports the completion unmatched instead of packing zeros."""
    rec = RouteRecorder(SimpleNamespace(input_batch=SimpleNamespace(req_ids=[])), layers=2, topk=2, moe=[0, 1])
    _Step(rec)([("c", 16, [1, 2])])
    assert rec.take() == {}


def test_recorder_refuses_a_step_that_does_not_lay_out_as_its_batch():
    rec = RouteRecorder(SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"])), layers=1, topk=2, moe=[0])
    rec.sched = SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"a": 2})
    with pytest.raises(RuntimeError, match="does not lay out as its batch"):
        rec.before_forward(None, (), {"input_ids": torch.zeros(3), "positions": torch.arange(3)})


def test_recorder_refuses_a_step_where_an_moe_layer_reported_nothing():
    rec = RouteRecorder(SimpleNamespace(input_batch=SimpleNamespace(req_ids=[])), layers=2, topk=2, moe=[0, 1])
    with pytest.raises(RuntimeError, match=r"MoE layers \[0, 1\] reported routes for \[0\]"):
        _Step(rec)([("a", 0, [1, 2])], layer_ids=(0,))


def test_engine_kwargs_cannot_set_the_routes_flag():
    from megarl.rollout.vllm.args import check_config
    cfg = RolloutConfig(name="vllm", engine_kwargs={"vllm": {"enable_return_routed_experts": True}})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.enable_return_routed_experts: is set by megarl "
                                          r"from rollout\.enable_rollout_routing_replay"):
        check_config(cfg)
