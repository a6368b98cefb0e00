"""A model family that says part of its architecture in code (megarl/models/families/hooks.py) and
has a model_type transformers does not know: its tiny checkpoint comes from its own description
(ModelFamily.tiny_config), the HF <-> megatron map round-trips it, and megatron-core (2 gloo ranks,
TP 2 with sequence parallelism) and the built-in engine compute what transformers computes for the
same tensors read as the architecture its hooks reproduce (Qwen3's q/k norm: QK_NORM).

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
from megarl.models.families.hooks import FamilyHooks
from megarl.models.families.qwen3 import QK_NORM
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
        path = make_tiny_hf(str(tmp_path / "hooked"), "hooked_lm", seed=3, num_hidden_layers=2)
        as_qwen3 = str(tmp_path / "as_qwen3")
        shutil.copytree(path, as_qwen3)
        cfg = json.load(open(f"{path}/config.json"))
        json.dump({**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
                  open(f"{as_qwen3}/config.json", "w"))
        yield path, as_qwen3
    finally:
        families.unregister("hooked_lm")


def test_hooks_default_to_nothing_and_qwen3_lives_in_its_file():
    """The shared files name no family's q/k norm: it is Qwen3's hook, and a plain family adds nothing."""
    plain = families.get("llama").hooks
    assert type(plain) is FamilyHooks and plain.layer_tensors(families.get("llama")) == {}
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
