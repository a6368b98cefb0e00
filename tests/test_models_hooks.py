"""A model family that says part of its architecture in code (megarl/models/families/hooks.py) and
has a model_type transformers does not know: its tiny checkpoint comes from its own description
(ModelFamily.tiny_config), the HF <-> megatron map round-trips it, and megatron-core (2 gloo ranks,
TP 2 with sequence parallelism) and the built-in engine compute what transformers computes for the
same tensors read as the architecture its hooks reproduce (Qwen3's q/k norm: QK_NORM). A hybrid
family (the norm on even layers only) shows the hooks see each layer's index, across pipeline
stages too; a family with a TP-split hook tensor (MLA-style) shows convert, the transfer plan and
the built-in engine's shard plan split it as declared, and a declaration the name contradicts is refused.

    python -m pytest -q tests/test_models_hooks.py
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers

from megarl.models import families
from megarl.models.families.base import NO_BIAS, ModelFamily, causal_and_score
from megarl.models.families.hooks import FamilyHooks, HookTensor
from megarl.models.families.qwen3 import QK_NORM, QkNorm
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import TEMP, TOL, hf_actor_reference, make_actor, make_batch

HOOKED = ModelFamily(name="hooked_lm", model_type="megarl_hooked_lm", architectures=causal_and_score("HookedLm"),
                     hooks=QK_NORM, refused=NO_BIAS)


def register_hooked() -> None:
    if "hooked_lm" not in families.names():
        families.register(HOOKED)


@pytest.fixture
def hooked(tmp_path):
    """The family registered for one test, its tiny checkpoint, and the same tensors as a Qwen3 one."""
    register_hooked()
    try:
        yield checkpoint_and_qwen3_twin(tmp_path, "hooked", seed=3)
    finally:
        families.unregister("hooked_lm")


def checkpoint_and_qwen3_twin(tmp_path, name: str, seed: int) -> tuple[str, str]:
    """A tiny checkpoint of the registered family `<name>_lm`, and the same tensors labelled Qwen3."""
    path = make_tiny_hf(str(tmp_path / name), f"{name}_lm", seed=seed, num_hidden_layers=2)
    as_qwen3 = str(tmp_path / "as_qwen3")
    shutil.copytree(path, as_qwen3)
    cfg = json.load(open(f"{path}/config.json"))
    json.dump({**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
              open(f"{as_qwen3}/config.json", "w"))
    return path, as_qwen3


def test_hooks_default_to_nothing_and_qwen3_lives_in_its_file():
    """The shared files name no family's q/k norm: it is Qwen3's hook, and a plain family adds nothing."""
    plain = families.get("llama").hooks
    assert type(plain) is FamilyHooks and plain.layer_tensors(families.get("llama"), 0) == {}
    assert families.get("qwen3").hooks is QK_NORM and families.get("qwen3_moe").hooks is QK_NORM
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for shared in ("megarl/models/convert.py", "megarl/models/build.py", "megarl/models/spec.py",
                   "megarl/rollout/native/model.py", "megarl/rollout/native/tp.py"):
        text = open(os.path.join(root, shared)).read()
        assert "qk_norm" not in text and "q_norm.weight" not in text and "q_layernorm" not in text, shared


def test_an_unknown_model_type_builds_from_its_description_and_maps_exactly(hooked):
    from megarl.models.convert import hf_shapes, hf_to_megatron, megatron_to_hf, rank_plan
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.rollout.native.engine import NativeEngine
    from megarl.rollout.native.kv_cache import KVCache
    path, as_qwen3 = hooked
    assert "megarl_hooked_lm" not in transformers.CONFIG_MAPPING
    ck = HFCheckpoint(path)
    spec = ck.spec()
    ck.validate(spec)
    hf = {n: ck.read_full(n) for n in ck.names()}
    assert set(hf) == set(hf_shapes(spec)) and hf["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    assert spec.num_parameters() == sum(t.numel() for t in hf.values())
    for tp in (1, 2):
        plan = rank_plan(spec, 0, tp, 0, 1)
        assert "decoder.layers.1.self_attention.q_layernorm.weight" in plan
        back = {}
        for name in plan:
            back.update(megatron_to_hf(name, [hf_to_megatron(name, hf, spec, r, tp) for r in range(tp)], spec))
        assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    # the built-in engine calls the hook (native_qk) and so computes Qwen3's logits
    engine = NativeEngine.from_pretrained(path, dtype="float32")
    assert engine.args.family == "hooked_lm"
    ids = torch.randint(3, 301, (10,), generator=torch.Generator().manual_seed(0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(as_qwen3, dtype=torch.float32)(ids[None]).logits[0, -1]
    m = engine.model
    cache = KVCache(m.a.n_layers, m.s.kv_heads, m.a.head_dim, torch.float32, "cpu")
    cache.ensure(1, 1, 16, 1)
    got = m.prefill(ids[None], torch.tensor([10]), cache, torch.zeros(1, dtype=torch.long), engine.comm)[0]
    assert (got - ref).abs().max().item() < TOL
    # without the hook's norm the logits differ: the check above sees it
    with torch.no_grad():
        for layer in m.blocks:
            layer.extra["self_attn_q_norm_weight"].fill_(1.0)
    moved = m.prefill(ids[None], torch.tensor([10]), cache, torch.zeros(1, dtype=torch.long), engine.comm)[0]
    assert (moved - ref).abs().max().item() > 1e-3


def megatron_parity(rank, world, path: str, ref: dict):
    register_hooked()                  # a fresh interpreter: the test's family registers here too
    actor = make_actor(path, 2, tp=2, sp=True)
    data = make_batch(301)
    names = {n for c in actor.engine.chunks for n, _ in c.named_parameters()}
    out = {"q_layernorm": any(n.endswith("self_attention.q_layernorm.weight") for n in names),
           "logits": (actor.engine.logits(data.batch["input_ids"], 2).cpu() - ref["logits"]).abs().max().item()}
    lp, _ = actor.compute_log_prob(data, TEMP)
    out["log_probs"] = (lp.cpu() - ref["log_probs"]).abs().max().item()
    from tests.helpers.megatron_roles import policy_loss
    actor.engine.accumulate(data, 2, actor._process(TEMP, True, True), policy_loss)
    grads = dict(actor.engine.hf_grads())
    out["grad_names"] = set(grads)
    out["grad"] = max((g.cpu() - ref["grads"][n]).abs().max().item() for n, g in grads.items())
    return out


@pytest.mark.timeout(600)
def test_megatron_builds_the_hooked_family_as_transformers_computes_it(hooked):
    path, as_qwen3 = hooked
    ref = hf_actor_reference(as_qwen3, make_batch(301))
    out = run_ranks(2, megatron_parity, (path, ref))
    assert out[0]["q_layernorm"], "the layer_spec hook put no q/k norm into megatron's layer"
    assert set().union(*(r["grad_names"] for r in out)) == set(ref["grads"])
    for r in out:
        assert r["logits"] < TOL and r["log_probs"] < TOL and r["grad"] < 1e-5, r


# -- a hybrid family: the layers differ by index ----------------------------------------------------------
class EvenQkNorm(QkNorm):
    """Qwen3's q/k norm on even layers only; odd layers are plain Llama attention."""

    def layer_tensors(self, dims, index):
        return super().layer_tensors(dims, index) if index % 2 == 0 else {}

    def layer_spec(self, layer, norm, index):
        if index % 2 == 0:
            super().layer_spec(layer, norm, index)

    def native_qk(self, q, k, weights, norm, index):
        return super().native_qk(q, k, weights, norm, index) if index % 2 == 0 else (q, k)


HYBRID = ModelFamily(name="hybrid_lm", model_type="megarl_hybrid_lm", architectures=causal_and_score("HybridLm"),
                     hooks=EvenQkNorm(), refused=NO_BIAS)


def register_hybrid() -> None:
    if "hybrid_lm" not in families.names():
        families.register(HYBRID)


def hybrid_reference(as_qwen3: str):
    """transformers' Qwen3 with the odd layers' q/k norms taken out: the hybrid, computed by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(as_qwen3, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        if i % 2:
            layer.self_attn.q_norm, layer.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    return model


@pytest.fixture
def hybrid(tmp_path):
    register_hybrid()
    try:
        yield checkpoint_and_qwen3_twin(tmp_path, "hybrid", seed=5)
    finally:
        families.unregister("hybrid_lm")


def test_a_hybrid_family_maps_and_runs_per_layer_in_the_built_in_engine(hybrid):
    from megarl.models.convert import hf_shapes, hf_to_megatron, megatron_to_hf, rank_plan
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.rollout.native.engine import NativeEngine
    from megarl.rollout.native.kv_cache import KVCache
    path, as_qwen3 = hybrid
    spec = HFCheckpoint(path).spec()
    shapes = hf_shapes(spec)
    assert "model.layers.0.self_attn.q_norm.weight" in shapes and "model.layers.1.self_attn.q_norm.weight" not in shapes
    assert spec.num_parameters() == sum(torch.Size(s).numel() for s in shapes.values())
    hf = {n: HFCheckpoint(path).read_full(n) for n in shapes}
    plan = rank_plan(spec, 0, 2, 0, 1)
    assert "decoder.layers.0.self_attention.k_layernorm.weight" in plan
    assert "decoder.layers.1.self_attention.k_layernorm.weight" not in plan
    back = {}
    for name in plan:
        back.update(megatron_to_hf(name, [hf_to_megatron(name, hf, spec, r, 2) for r in range(2)], spec))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    engine = NativeEngine.from_pretrained(path, dtype="float32")
    m = engine.model
    assert [sorted(b.extra) for b in m.blocks] == [["self_attn_k_norm_weight", "self_attn_q_norm_weight"], []]
    ids = torch.randint(3, 301, (10,), generator=torch.Generator().manual_seed(1))
    ref = hybrid_reference(as_qwen3)(ids[None]).logits[0, -1]
    cache = KVCache(m.a.n_layers, m.s.kv_heads, m.a.head_dim, torch.float32, "cpu")
    cache.ensure(1, 1, 16, 1)
    got = m.prefill(ids[None], torch.tensor([10]), cache, torch.zeros(1, dtype=torch.long), engine.comm)[0]
    assert (got - ref).abs().max().item() < TOL
    # every layer normed (Qwen3 as transformers loads it) is a different model: the check above sees it
    qwen3 = transformers.AutoModelForCausalLM.from_pretrained(as_qwen3, dtype=torch.float32)(ids[None]).logits[0, -1]
    assert (qwen3 - ref).abs().max().item() > 1e-3


def megatron_hybrid(rank, world, path: str, ref: dict):
    register_hybrid()
    actor = make_actor(path, 2, pp=2)   # stage 1 builds global layer 1: the hook must get 1, not 0
    data = make_batch(301)
    names = {n for c in actor.engine.chunks for n, _ in c.named_parameters()}
    lp, _ = actor.compute_log_prob(data, TEMP)
    from tests.helpers.megatron_roles import policy_loss
    actor.engine.accumulate(data, 2, actor._process(TEMP, True, True), policy_loss)
    grads = dict(actor.engine.hf_grads())
    return {"q_layernorm": any(n.endswith("q_layernorm.weight") for n in names),
            "log_probs": (lp.cpu() - ref["log_probs"]).abs().max().item(), "grad_names": set(grads),
            "grad": max((g.cpu() - ref["grads"][n]).abs().max().item() for n, g in grads.items())}


@pytest.mark.timeout(600)
def test_megatron_builds_a_hybrid_family_per_layer_across_pipeline_stages(hybrid):
    from tests.helpers.megatron_roles import hf_policy_backward
    path, as_qwen3 = hybrid
    data = make_batch(301)
    model = hybrid_reference(as_qwen3)
    lp, _ = hf_policy_backward(model(data.batch["input_ids"]).logits, data)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    out = run_ranks(2, megatron_hybrid, (path, {"log_probs": lp.detach(), "grads": grads}))
    assert [r["q_layernorm"] for r in out] == [True, False], "stage 1's layer got the hook of layer 0"
    assert set().union(*(r["grad_names"] for r in out)) == set(grads)
    for r in out:
        assert r["log_probs"] < TOL and r["grad"] < 1e-5, r


# -- a hook tensor split over TP ranks (MLA-style) ---------------------------------------------------------
class KvUp(FamilyHooks):
    """An up-projection beside the shared attention, its rows split over TP (split=0)."""
    suffix, split = "self_attention.linear_kv_up_proj.weight", 0

    def layer_tensors(self, dims, index):
        shape = (4 * dims.head_dim, dims.hidden_size)
        return {self.suffix: HookTensor("self_attn.kv_b_proj.weight", shape, self.split)}


def split_family(name: str, hooks: FamilyHooks) -> ModelFamily:
    return ModelFamily(name=name, model_type=f"megarl_{name}", architectures=causal_and_score(name.title()),
                       hooks=hooks, refused=NO_BIAS)


@pytest.fixture
def split_spec(tmp_path):
    from megarl.models.hf_checkpoint import HFCheckpoint
    families.register(split_family("split_lm", KvUp()))
    try:
        path = make_tiny_hf(str(tmp_path / "split"), "split_lm", seed=7, num_hidden_layers=2)
        ck = HFCheckpoint(path)
        yield path, ck.spec(), {n: ck.read_full(n) for n in ck.names()}
    finally:
        families.unregister("split_lm")


def test_a_split_hook_tensor_round_trips_at_tp2_in_convert_and_the_transfer_plan(split_spec):
    from megarl.checkpoint_engine.plan import build_plan, gathered_to_hf, split_shard
    from megarl.models.convert import Slice, hf_to_megatron, megatron_to_hf, shard_shape, tp_dim
    path, spec, hf = split_spec
    name = "decoder.layers.1.self_attention.linear_kv_up_proj.weight"
    full = hf["model.layers.1.self_attn.kv_b_proj.weight"]
    rows = full.shape[0] // 2
    assert tp_dim(name, spec=spec) == 0 and shard_shape(name, spec, 2) == (rows, spec.hidden_size)
    shards = [hf_to_megatron(name, hf, spec, r, 2) for r in range(2)]
    assert torch.equal(shards[1], full[rows:])
    assert [(n, torch.equal(t, full)) for n, t in megatron_to_hf(name, shards, spec)] == \
        [("model.layers.1.self_attn.kv_b_proj.weight", True)]
    # the checkpoint engine: gathered over TP unless held locally, and each shard names its rows
    entry = {e.name: e for b in build_plan(spec, 2, 1, 1 << 20, 4).buckets for e in b.entries}[name]
    assert entry.gather and entry.shape == (rows, spec.hidden_size)
    assert not {e.name: e for b in build_plan(spec, 2, 1, 1 << 20, 4, local={name}).buckets
                for e in b.entries}[name].gather
    assert split_shard(name, shards[1], spec, 1, 2)[0][0] == Slice("model.layers.1.self_attn.kv_b_proj.weight", 0,
                                                                   rows, 2 * rows)
    assert torch.equal(gathered_to_hf(name, shards, spec)[0][1], full)
    # the built-in engine's TP rank 1 loads its rows of it
    from megarl.rollout.base import ShardSlice
    from megarl.rollout.native.model import ModelArgs, Transformer
    from megarl.rollout.native.tp import ShardPlan
    args = ModelArgs.from_hf(json.load(open(f"{path}/config.json")))
    assert ShardPlan(args, 1, 2).target("model.layers.1.self_attn.kv_b_proj.weight") == \
        ("layers.1.extra.self_attn_kv_b_proj_weight", slice(None), ShardSlice(0, rows, 2 * rows))
    assert Transformer(args, 2).blocks[1].extra["self_attn_kv_b_proj_weight"].shape == (rows, spec.hidden_size)


@pytest.mark.parametrize("suffix,split,reads", [
    ("self_attention.linear_qkv_down.weight", None, "split=0"),     # reads as split, declared whole
    ("mlp.side.linear_fc2.weight", 0, "split=1"),                     # reads as split along another dim
    ("self_attention.linear_kv_up_proj.weight", 2, "names no dim"),    # a 2-d tensor has no dim 2
])
def test_a_hook_tensor_split_the_name_contradicts_is_refused_in_one_line(split_spec, suffix, split, reads):
    import dataclasses

    from megarl.models.convert import hf_shapes
    bad = KvUp()
    bad.suffix, bad.split = suffix, split
    families.register(split_family("bad_split_lm", bad))
    try:
        spec = dataclasses.replace(split_spec[1], family="bad_split_lm")
        with pytest.raises(ValueError) as err:
            hf_shapes(spec)
        msg = str(err.value)
        assert "\n" not in msg and f"declares split={split}" in msg and reads in msg and "bad_split_lm" in msg
    finally:
        families.unregister("bad_split_lm")
