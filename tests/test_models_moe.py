"""Qwen3 (q/k norm), Mistral, Qwen3-MoE and Qwen2-MoE on real megatron-core and 4 gloo ranks,
transformers as the oracle; expert parallel (EP) and its weight sync into the built-in engine.
megatron trains MoE at TP > 1 only with sequence parallelism (on by default at TP > 1; megarl
refuses MoE training at TP > 1 with it switched off), so every layout, TP2 x EP2 included, trains.

One spawn walks the layouts (TP, PP, EP) below and checks, per layout: HF -> megatron -> HF
bit-exact (the export all-gathers experts over EP), logits, log-probs and entropy, the gradient of
a policy loss against transformers' autograd (router aux loss off, as transformers' model adds
none unless asked), one update. Then for Qwen3-MoE: the load-balancing loss in the metrics (TP1 x
EP2) equals the value computed from transformers' router logits, and (TP2 x EP2) a weight sync into the
native engine at rollout TP 2 and 1 is exact (every expert, from the other EP rank too) and gives
the actor's log-probs. Pure checks (specs, refusals, engine vs transformers) run in-process.

    python -m pytest -q tests/test_models_moe.py
"""
from __future__ import annotations

import pytest
import torch

from megarl.models import families
from megarl.models.families.qwen3 import QK_NORM
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import (TEMP, TOL, assert_same_tensors, hf_actor_reference, make_actor, make_batch,
                                          policy_loss)

# (family, TP, PP, EP, micro-batch); DP = 4 / (TP x PP); EP takes DP ranks.
LAYOUTS = [("qwen3", 2, 2, 1, 2), ("mistral", 2, 1, 1, 2), ("qwen3_moe", 1, 1, 2, 2), ("qwen3_moe", 2, 1, 2, 2),
           ("qwen2_moe", 1, 2, 2, 2), ("qwen2_moe", 2, 1, 2, 4)]
NO_AUX = {"router_aux_loss_coef": 0.0}


def check_models(rank, world, models: dict, refs: dict, hf_tensors: dict, ckpt_dir: str):
    from tests.helpers.checkpoint_engine import (engine_mismatch, experiment, full_export, native_engine, perturb,
                                                 rollout_groups, rollout_vs_actor)
    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.parallel import state

    def diff(a, b):
        return (a.cpu() - b).abs().max().item()

    out: dict = {"layouts": {}}
    for family, tp, pp, ep, micro in LAYOUTS:
        ref, data = refs[family], make_batch(301)
        actor = make_actor(models[family], micro, tp=tp, pp=pp, ep=ep, override=NO_AUX)
        exported = full_export(actor)
        r = {"export_exact": sorted(exported) == sorted(hf_tensors[family]) and
             all(torch.equal(exported[n], hf_tensors[family][n]) for n in exported),
             "logits": diff(actor.engine.logits(data.batch["input_ids"], micro), ref["logits"])}
        lp, ent = actor.compute_log_prob(data, TEMP)
        r["log_probs"], r["entropy"] = diff(lp, ref["log_probs"]), diff(ent, ref["entropy"])
        out["layouts"][(family, tp, pp, ep)] = r
        if (family, tp, pp, ep) == ("qwen2_moe", 1, 2, 2):  # a distributed checkpoint of the untrained model
            actor.save_checkpoint(f"{ckpt_dir}/qwen2_moe")
        # entropy_grad: policy_loss has an entropy bonus, so the entropy must carry gradients
        actor.engine.accumulate(data, micro, actor._process(TEMP, True, True), policy_loss)
        grads = dict(actor.engine.hf_grads())
        r["grad"] = max(diff(g, ref["grads"][n]) for n, g in grads.items())
        r["grad_names"] = set(grads)
        r["metrics"] = actor.update_policy(data, policy_loss, TEMP)
        r["moved"] = diff(actor.compute_log_prob(data, TEMP)[0], ref["log_probs"])
        del actor
        state.destroy_model_parallel()

    # Resume across a layout change: saved at PP2 x EP2, loaded at EP4 (one expert per rank).
    actor = make_actor(models["qwen2_moe"], 2, tp=1, pp=1, ep=4, override=NO_AUX)
    actor.load_checkpoint(f"{ckpt_dir}/qwen2_moe")
    out["resumed_ep4"] = diff(actor.compute_log_prob(make_batch(301), TEMP)[0], refs["qwen2_moe"]["log_probs"])
    del actor
    state.destroy_model_parallel()

    # The aux loss as the HF config says (router_aux_loss_coef=0.01), and the weight sync under EP.
    path = models["qwen3_moe"]
    data = make_batch(301)
    actor = make_actor(path, 2, tp=1, pp=1, ep=2)
    for c in actor.engine.chunks:
        c.train()                          # the router adds its loss in training mode only
    actor.engine.accumulate(data, 2, actor._process(TEMP, True, True), policy_loss)
    out["aux_grads"] = dict(actor.engine.hf_grads())
    out["aux_metrics"] = actor.update_policy(data, policy_loss, TEMP)
    del actor
    state.destroy_model_parallel()
    actor = make_actor(path, 2, tp=2, pp=1, ep=2)
    out["sync"] = {}
    for rtp in (2, 1):
        group = rollout_groups(rtp)
        engine = native_engine(path, group)
        sync = build_checkpoint_engine(experiment(path, 2, 1, rtp), actor, engine, group)
        sync.sync()
        s = {"logprob": rollout_vs_actor(engine, actor)[0]}
        perturb(actor)
        sync.sync()
        s["exact"] = engine_mismatch(engine, full_export(actor))
        s["logprob_after"] = rollout_vs_actor(engine, actor, seed=1)[0]
        out["sync"][rtp] = s
        del engine, sync
    del actor
    state.destroy_model_parallel()
    return out


def hf_aux_reference(path: str, data, micro: int, dp: int) -> tuple[float, dict]:
    """megatron's switch load-balancing loss per layer and micro-batch (unscaled by its
    coefficient), from transformers' router logits: E / (k T^2) * sum_e P_e * n_e with P_e the
    summed softmax probability and n_e the tokens routed to expert e, over the T real (not
    padding) tokens. Returns its mean over layers
    and micro-batches, and the gradient of the policy loss + coef * (sum over layers, mean over
    micro-batches) of it, which is what megarl's update should apply."""
    from transformers import AutoModelForCausalLM
    from megarl.workers.batching import dp_slice, seq_len
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    E, k, S = model.config.num_local_experts, model.config.num_experts_per_tok, seq_len(data)
    coef = model.config.router_aux_loss_coef
    values = []
    for r in range(dp):
        for mb in dp_slice(data, r, dp).split(micro):
            logits = model(mb.batch["input_ids"][:, :S], output_router_logits=True).router_logits
            valid = (torch.arange(S)[None] < (mb.batch["prompt_lens"] + mb.batch["response_lens"])[:, None]).flatten()
            for layer in logits:
                probs = layer[valid].float().softmax(-1)                                # [T real tokens, E]
                counts = torch.zeros(E).index_add_(0, probs.topk(k, -1).indices.flatten(),
                                                   torch.ones(probs.shape[0] * k))
                T = probs.shape[0]
                values.append((probs.sum(0) * counts).sum() * E / (k * T * T))
    micro_batches = len(values) // len(logits)
    (coef * sum(values) / micro_batches).backward()
    aux_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(sum(values).detach() / len(values)), per_expert(aux_grads)


def per_expert(grads: dict) -> dict:
    """transformers 5 holds a layer's experts fused in memory (experts.gate_up_proj [E, 2f, h],
    experts.down_proj [E, h, f]); checkpoints, and megarl, name them per expert."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(g):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": w for e, w in enumerate(g)})
        else:
            out[name] = g
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {f: make_tiny_hf(str(root / f), f, seed=i + 5, vocab_size=301)
            for i, f in enumerate(("qwen3", "mistral", "qwen3_moe", "qwen2_moe"))}


@pytest.mark.timeout(900)
def test_new_architectures_and_expert_parallel_match_transformers(tiny_models, tmp_path):
    from megarl.models.hf_checkpoint import HFCheckpoint
    refs, tensors = {}, {}
    for family, path in tiny_models.items():
        if family.endswith("_moe"):   # the HF model adds no aux loss: compare with it switched off
            import json
            cfg = json.load(open(f"{path}/config.json"))
            assert cfg["router_aux_loss_coef"] == 0.01
        refs[family] = hf_actor_reference(path, make_batch(301))
        refs[family]["grads"] = per_expert(refs[family]["grads"])
        ck = HFCheckpoint(path)
        tensors[family] = {n: ck.read_full(n) for n in ck.names()}
    out = run_ranks(4, check_models, (tiny_models, refs, tensors, str(tmp_path)))
    ranks, out = out, out[0]
    for key, r in out["layouts"].items():
        assert r["export_exact"], key
        assert r["logits"] < TOL and r["log_probs"] < TOL and r["entropy"] < TOL, (key, r)
        if "metrics" not in r:
            continue
        assert r["grad"] < 1e-5, (key, r["grad"])
        covered = set().union(*(rk["layouts"][key]["grad_names"] for rk in ranks))
        assert covered == set(refs[key[0]]["grads"]), (key, covered ^ set(refs[key[0]]["grads"]))
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(refs[key[0]]["grad_norm"], rel=1e-5), key
        assert r["moved"] > 1e-3, key
        # coefficient 0: megatron computes no load-balancing loss, and none is reported
        assert "actor/moe_aux_loss" not in r["metrics"], key
    # TP1 x EP2 -> DP 4, micro-batches of 2 over a mini-batch of 8
    want, aux_grads = hf_aux_reference(tiny_models["qwen3_moe"], make_batch(301), micro=2, dp=4)
    assert out["aux_metrics"]["actor/moe_aux_loss"] == pytest.approx(want, rel=1e-4)
    # the gradient with the aux loss on = policy-loss gradient + coef x d(mean over micro-batches)
    got = {n: g for rk in ranks for n, g in rk["aux_grads"].items()}
    ref = refs["qwen3_moe"]["grads"]
    assert sorted(got) == sorted(ref)
    assert max((got[n] - ref[n] - aux_grads.get(n, 0)).abs().max().item() for n in got) < 1e-5
    assert max(aux_grads[n].abs().max().item() for n in aux_grads) > 1e-4   # the aux term is not negligible
    assert out["resumed_ep4"] < TOL
    # the MoE distributed checkpoint exports back to the HF tensors, bit for bit
    from checkpoints_tools.megatron_to_hf import export
    export(str(tmp_path / "qwen2_moe"), str(tmp_path / "qwen2_moe_hf"), trust_unsealed=True)
    assert_same_tensors(tiny_models["qwen2_moe"], str(tmp_path / "qwen2_moe_hf"))
    for rtp, s in out["sync"].items():
        assert s["logprob"] < TOL and s["logprob_after"] < TOL, (rtp, s)
        assert s["exact"] == (0.0, []), (rtp, s["exact"])


# -- in-process checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", families.names())
def test_conversion_round_trip_and_native_engine(family, tmp_path):
    """For every registered family (a new one is tested by registering it), its tiny checkpoint
    built from its own description: HF -> megatron shards (TP 1, 2) -> HF bit-exact, and the
    built-in engine's logits equal transformers' where transformers knows the model_type (the
    engine reads these models on its own)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from megarl.models.convert import hf_shapes, hf_to_megatron, megatron_to_hf, rank_plan
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.rollout.native.engine import NativeEngine
    from megarl.rollout.native.kv_cache import KVCache
    path = make_tiny_hf(str(tmp_path / family), family, tokenizer=False, num_hidden_layers=2)
    ck = HFCheckpoint(path)
    spec = ck.spec()
    ck.validate(spec)
    hf = {n: ck.read_full(n) for n in ck.names()}
    assert set(hf) == set(hf_shapes(spec))
    for tp in (1, 2):
        back = {}
        for name in rank_plan(spec, 0, tp, 0, 1):
            back.update(megatron_to_hf(name, [hf_to_megatron(name, hf, spec, r, tp) for r in range(tp)], spec))
        assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    engine = NativeEngine.from_pretrained(path, dtype="float32")
    ids = torch.randint(3, 301, (10,), generator=torch.Generator().manual_seed(0))
    m = engine.model
    cache = KVCache(m.a.n_layers, m.s.kv_heads, m.a.head_dim, torch.float32, "cpu")
    cache.ensure(1, 1, 16, 1)
    one = torch.zeros(1, dtype=torch.long)     # one prompt of 10 tokens into group 0
    got = m.prefill(ids[None], torch.tensor([10]), cache, one, engine.comm)[0]
    assert got.isfinite().all()
    if spec.model_family.model_type in CONFIG_MAPPING:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids[None]).logits[0, -1]
        assert (got - ref).abs().max().item() < TOL


def test_specs_and_refusals(tmp_path):
    from megarl.models.spec import ModelSpec, check_layout, check_window
    import json
    paths = {f: make_tiny_hf(str(tmp_path / f), f, tokenizer=False, num_hidden_layers=2)
             for f in ("qwen3", "mistral", "qwen3_moe", "qwen2_moe")}
    cfg = {f: json.load(open(f"{p}/config.json")) for f, p in paths.items()}
    q3, q3m, q2m, mis = (ModelSpec.from_hf_config(cfg[f]) for f in ("qwen3", "qwen3_moe", "qwen2_moe", "mistral"))
    assert q3.model_family.hooks is QK_NORM and not q3.qkv_bias and not q3.is_moe
    assert q3m.is_moe and q3m.moe_norm_topk and q3m.num_experts == 4 and q3m.moe_topk == 2
    assert q3m.model_family.hooks is QK_NORM
    assert q2m.shared_expert_ffn == 48 and not q2m.moe_norm_topk and q2m.qkv_bias and q2m.aux_loss_coef == 0.01
    assert mis.sliding_window == 4096
    check_layout(q3m, tp=2, pp=1, ep=2, world=4)
    check_layout(q3m, tp=1, pp=1, ep=4, world=4)
    with pytest.raises(ValueError,
                       match=r"expert_model_parallel_size=3 does not divide num_experts=4; pick one of \[1, 2, 4\]"):
        check_layout(q3m, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError,
                       match=r"must divide the data-parallel size 1 .* use expert_model_parallel_size in \[1\]"):
        check_layout(q3m, tp=2, pp=2, ep=2, world=4)
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        check_layout(q3, tp=1, pp=1, ep=2)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=1 differs"):
        check_layout(q3m, tp=2, pp=1, ep=1, etp=1)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config({**cfg["qwen3_moe"], "mlp_only_layers": [0]})
    check_window(mis, 4096)
    with pytest.raises(ValueError, match="sliding_window=4096 but sequences may reach 5000"):
        check_window(mis, 5000)


def test_config_refuses_bad_expert_layouts_before_building(tmp_path):
    """One line naming the key and a layout that works, from the experiment config (no rank starts)."""
    import json
    from megarl.experiment import load_config
    from megarl.config.errors import ConfigError
    path = make_tiny_hf(str(tmp_path / "m"), "qwen3_moe", tokenizer=False, num_hidden_layers=2)
    hf = json.load(open(f"{path}/config.json"))

    def cfg(*extra):
        return load_config(None, [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=4",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *extra])
    cfg("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2").check_model(hf)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron.expert_model_parallel_size: .*does not "
                                          r"divide num_experts=4"):
        cfg("actor_rollout_ref.actor.megatron.expert_model_parallel_size=3").check_model(hf)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size: expert_model_parallel_size=4 must divide the "
                                          r"data-parallel size 2 .* use expert_model_parallel_size in \[1, 2\]"):
        cfg("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=true",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4").check_model(hf)
    with pytest.raises(ConfigError, match=r"actor.megatron.sequence_parallel: a MoE model trains at TP 2 > 1 only "
                                          r"with sequence parallelism"):
        cfg("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=false").check_model(hf)
    # sequence parallel is on by default at TP > 1, so the same layout without the override holds
    cfg("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2").check_model(hf)
    with pytest.raises(ConfigError, match="MoE models are not supported with context parallelism"):
        cfg("actor_rollout_ref.actor.megatron.context_parallel_size=2").check_model(hf)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size"):
        cfg("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1")
    mistral = make_tiny_hf(str(tmp_path / "mis"), "mistral", tokenizer=False, num_hidden_layers=2, sliding_window=600)
    with pytest.raises(ConfigError,
                       match=r"data.max_response_length: .*sliding_window=600 but sequences may reach 1024"):
        load_config(None, [f"actor_rollout_ref.model.path={mistral}"]).check_model(
            json.load(open(f"{mistral}/config.json")))
