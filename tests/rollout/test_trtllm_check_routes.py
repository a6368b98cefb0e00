"""benchmarks/trtllm_check.py's R3 measure: TensorRT-LLM's routed experts against megatron's router,
on a tiny Qwen3-MoE checkpoint.

FAKE: tensorrt_llm cannot run here; the conformance fake (tests/rollout/trtllm_fake*.py) stands in,
its model a real transformers Qwen3-MoE. Its routes are that model's own router's top-k on the fed
tokens (what PR #18397 returns: [fed positions, MoE layers, top-k]), or the same routes shuffled
over positions (a broken alignment). megatron, its router and the check's procedure are real.
"""
from __future__ import annotations

import pytest
import torch

from tests.rollout import trtllm_fake

V29 = "trtllm-1.3.0rc29.json"
EXPERTS, TOP_K = 8, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _router_routes(model, fed: list[int]) -> torch.Tensor:
    """[len(fed), MoE layers, top-k]: each layer's Qwen3MoeTopKRouter indices on one full forward."""
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(out[2]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([fed]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1).to(torch.int16)


def _per_expert_views(model) -> dict[str, tuple[str, torch.Tensor]]:
    """Checkpoint name -> (parameter name, view into it). transformers 5 holds a layer's experts
    fused (experts.gate_up_proj [E, 2f, h], experts.down_proj [E, h, f]); checkpoints, megarl's
    export and TensorRT-LLM's loader name them per expert."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(p.data):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = (name, gate), (name, up)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": (name, w) for e, w in enumerate(p.data)})
        else:
            out[name] = (name, p.data)
    return out


def _load_per_expert(self, named) -> None:
    """The fake's _load with per-expert names: an unknown name fails the bucket; a fused parameter
    counts as reloaded once every expert's piece of it has arrived."""
    views = _per_expert_views(self.model)
    pending = getattr(self, "pieces", None) or {}
    size = 0
    for name, tensor in named:
        if name not in views:
            raise KeyError(f"no parameter {name} in the model")
        param, view = views[name]
        view.copy_(tensor)
        size += tensor.numel() * tensor.element_size()
        left = pending.setdefault(param, {n for n, (q, _) in views.items() if q == param})
        left.discard(name)
        if not left:
            self.outstanding.discard(param)
            del pending[param]
    self.pieces = pending
    self._account(size, "bucket in")
    self._account(-size, "bucket out")


def _engine_routes(shuffle: bool) -> None:
    """The fake's LLM loads per-expert names and returns its model's router routes (shuffled over
    positions when asked)."""
    from tests.rollout import trtllm_fake_llm
    one = trtllm_fake_llm._LLM._one

    def patched(self, prompt, sp):
        out = one(self, prompt, sp)
        for c in out.outputs:
            if getattr(c, "routed_experts", None) is not None:
                fed = (list(prompt) + list(c.token_ids))[:len(c.routed_experts)]
                routes = _router_routes(self.model, fed)
                if shuffle:
                    routes = routes[torch.randperm(len(fed), generator=torch.Generator().manual_seed(0))]
                c.routed_experts = routes.numpy()
        return out
    trtllm_fake_llm._LLM._one = patched
    trtllm_fake_llm._LLM._load = _load_per_expert


def _procedure(rank, world, model_dir, shuffle):
    from benchmarks import trtllm_check
    trtllm_fake.install_in_process(V29)
    _engine_routes(shuffle)
    torch.set_num_threads(1)
    result = {"phases": {}}
    trtllm_check._phases(rank, world, model_dir, {"max_tokens": 6, "gpu_memory_utilization": 0.3}, result,
                         device="cpu")
    return result


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("trtllm_check_moe") / "m"), "qwen3_moe", seed=3, vocab_size=301,
                        num_experts=EXPERTS, num_experts_per_tok=TOP_K)


@pytest.mark.timeout(600)
def test_routes_of_the_router_pass_and_shuffled_routes_fail(moe_dir):
    from benchmarks import trtllm_check, trtllm_check_routes
    from tests.distributed import run_ranks
    (good,) = run_ranks(1, _procedure, (moe_dir, False))
    r3 = good["r3"]
    import json
    import os
    layers = json.load(open(os.path.join(moe_dir, "config.json")))["num_hidden_layers"]
    assert len(r3["per_layer"]) == layers and r3["top_k"] == TOP_K and r3["positions"] > 4 * 80
    # fp32 on both sides, one set of weights: transformers' router and megatron's pick the same experts
    assert r3["passed"] and r3["overall"] == 1.0 and r3["prompt"] == 1.0 and r3["response"] == 1.0
    assert good["logprob_max_abs_diff_before_sleep"] <= 1e-4, "megatron replays the engine's routes"
    assert r3["logprob_max_abs_diff_own_routes"] <= 1e-4
    assert "megatron_routes" in good["phases"]
    assert trtllm_check.verdict({"ok": True, "ranks": [good]})

    (bad,) = run_ranks(1, _procedure, (moe_dir, True))
    r3 = bad["r3"]
    assert not r3["passed"] and max(r3["per_layer"]) < trtllm_check_routes.R3_MIN and r3["overall"] < 0.5
    assert not trtllm_check.verdict({"ok": True, "ranks": [bad]}), "shuffled routes fail the check"
    assert not trtllm_check.verdict({"ok": True, "ranks": [dict(good, r3=r3)]}), "the routes alone fail it"
    md = trtllm_check.markdown({"date": "d", "versions": {}, "runs": [{"tp": 1, "ok": True, "verdict": False,
                                                                       "ranks": [dict(bad, ok=True)]}]})
    assert "## TP 1: FAILED" in md and "R3 routes, TensorRT-LLM against megatron's router" in md
    assert "R3 agreement per MoE layer: " in md and "every layer needs 0.8" in md


def test_route_agreement_counts_fed_positions_only():
    """Per layer, equal top-k sets whatever their order; a row's last real position (a copy, never
    fed) and padding are not counted; prompt and response apart."""
    from benchmarks.trtllm_check_routes import route_agreement
    from megarl.protocol import DataProto
    engine = torch.zeros(2, 5, 2, 2, dtype=torch.uint8)
    engine[..., 0], engine[..., 1] = 1, 3
    ours = engine.clone().flip(-1)                  # the same sets in the other order
    ours[0, 1, 1] = torch.tensor([1, 2])            # row 0, a prompt position, layer 1: differs
    ours[0, 3] = 7                                  # row 0's last real position: not fed, not counted
    ours[1, 4] = 7                                  # row 1's padding
    batch = DataProto.from_dict({"routed_experts": engine, "prompt_lens": torch.tensor([2, 1]),
                                 "response_lens": torch.tensor([2, 2])})
    got = route_agreement(batch, ours)
    assert got["positions"] == 3 + 2
    assert got["per_layer"] == [1.0, 0.8] and got["overall"] == 0.9 and got["response"] == 1.0
    assert got["prompt"] == pytest.approx(5 / 6, abs=1e-6) and got["passed"]
    ours[1, :2, 0] = 6                              # row 1's two fed positions, layer 0
    assert route_agreement(batch, ours)["per_layer"][0] == 0.6 and not route_agreement(batch, ours)["passed"]
    with pytest.raises(ValueError, match=r"differ in shape"):
        route_agreement(batch, ours[:, :4])
