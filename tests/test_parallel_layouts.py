"""Sequence parallel, context parallel and virtual pipeline on real megatron-core and 4 gloo ranks,
with transformers as the oracle (megarl/models/{norm,context_parallel}.py, megarl/workers/engine.py).

One spawn walks the layouts (TP, CP, PP, VPP, SP): TP2 with SP off (logits and gradients only)
then on, PP2 x VPP2, TP2xSP x CP2, CP2 x PP2 x VPP2 (whose CP1 twin is PP2 x VPP2), on a Qwen2 model
(QKV bias, GQA 4/2, vocab 301 not divisible by TP) whose batch has sequence lengths that SP/CP
must pad. Per layout: logits, log-probs and entropy vs transformers (<= 1e-4), the accumulated
gradient vs transformers' autograd (<= 1e-5), one update step. SP on vs off and CP2 vs CP1:
logits and gradients <= 1e-5. The same spawn exports HF tensors from the VPP chunks bit-exact,
saves a checkpoint per chunk at PP2 x VPP2 and resumes it at TP2xSP x CP2 (model, optimizer, LR).
"""
from __future__ import annotations

import os

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import (TEMP, TOL, diff, grad_errors, hf_actor_reference, make_actor, make_batch,
                                          policy_loss)

# (TP, CP, PP, VPP, SP, micro); DP = 4 / (TP x CP x PP)
LAYOUTS = {
    "tp2": (2, 1, 1, None, False, 2),
    "tp2_sp": (2, 1, 1, None, True, 2),
    "pp2_vpp2": (1, 1, 2, 2, False, 2),
    "tp2_sp_cp2": (2, 2, 1, None, True, 2),
    "cp2_pp2_vpp2": (1, 2, 2, 2, False, 2),
}


def _hf_grads(engine) -> dict:
    return {n: g.cpu() for n, g in engine.hf_grads()}


def check_layouts(rank, world, path: str, ref: dict, ckpt_dir: str):
    from megarl.parallel import state
    data = make_batch(301, seed=5)
    out: dict = {"layouts": {}}
    for key, (tp, cp, pp, vpp, sp, micro) in LAYOUTS.items():
        actor = make_actor(path, micro, tp=tp, cp=cp, pp=pp, vpp=vpp, sp=sp)
        eng = actor.engine
        r = {"sp": eng.config.sequence_parallel, "chunks": len(eng.models)}
        logits = eng.logits(data.batch["input_ids"], micro)
        r["logits"] = diff(logits, ref["logits"])
        r["logits_raw"] = logits
        lp, ent = actor.compute_log_prob(data, TEMP)
        r["log_probs"], r["entropy"] = diff(lp, ref["log_probs"]), diff(ent, ref["entropy"])
        eng.accumulate(data, micro, actor._process(TEMP, True, True), policy_loss)
        r["grad"], r["grad_names"] = grad_errors(eng, ref["grads"])
        r["grads_raw"] = _hf_grads(eng) if key in ("tp2", "tp2_sp", "cp2_pp2_vpp2", "pp2_vpp2") else None
        if key == "tp2":  # the SP-off twin: logits and gradients are all it is for
            out["layouts"][key] = r
            del actor, eng
            state.destroy_model_parallel()
            continue
        if key == "pp2_vpp2":  # HF -> megatron chunks -> HF, bit for bit, before any update
            r["export"] = {n: t.clone() for n, t in eng.hf_tensors()}
        r["metrics"] = actor.update_policy(data, policy_loss, TEMP)
        r["moved"] = diff(actor.compute_log_prob(data, TEMP)[0], ref["log_probs"])
        if key == "pp2_vpp2":  # a checkpoint per chunk, then one more step to compare the resume with
            actor.save_checkpoint(os.path.join(ckpt_dir, "vpp"))
            r["lp_saved"] = actor.compute_log_prob(data, TEMP)[0]
            actor.update_policy(data, policy_loss, TEMP)
            r["lp_after"] = actor.compute_log_prob(data, TEMP)[0]
        out["layouts"][key] = r
        del actor, eng
        state.destroy_model_parallel()
    # Resume the PP2 x VPP2 checkpoint under TP2xSP x CP2 (no chunks, another TP and CP).
    for key in ("tp2_sp_cp2",):
        tp, cp, pp, vpp, sp, micro = LAYOUTS[key]
        actor = make_actor(path, micro, tp=tp, cp=cp, pp=pp, vpp=vpp, sp=sp)
        actor.load_checkpoint(os.path.join(ckpt_dir, "vpp"))
        loaded = actor.compute_log_prob(data, TEMP)[0]
        actor.update_policy(data, policy_loss, TEMP)
        out[f"resume_{key}"] = (loaded, actor.compute_log_prob(data, TEMP)[0])
        del actor
        state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("par") / "qwen2"), "qwen2", seed=1, vocab_size=301)


@pytest.mark.timeout(900)
def test_sp_cp_vpp_match_transformers(qwen2, tmp_path):
    ref = hf_actor_reference(qwen2, make_batch(301, seed=5))
    ranks = run_ranks(4, check_layouts, (qwen2, ref, str(tmp_path)))
    out = ranks[0]
    lays = out["layouts"]
    for key, r in lays.items():
        assert r["logits"] < TOL and r["grad"] < 1e-5, (key, r["logits"], r["grad"])
        if key == "tp2":
            continue
        assert r["logits"] < TOL and r["log_probs"] < TOL and r["entropy"] < TOL, (key, r["logits"])
        assert r["grad"] < 1e-5, (key, r["grad"])
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), key
        assert r["metrics"]["actor/skipped_steps"] == 0 and r["moved"] > 1e-3, key
        covered = set().union(*(rk["layouts"][key]["grad_names"] for rk in ranks))
        assert covered == set(ref["grads"]), key
    assert lays["tp2_sp"]["sp"] and not lays["tp2"]["sp"] and lays["tp2_sp_cp2"]["sp"]
    assert lays["pp2_vpp2"]["chunks"] == 2 and lays["cp2_pp2_vpp2"]["chunks"] == 2
    # SP on vs off, CP2 vs CP1: same logits and gradients in fp32.
    for a, b in (("tp2_sp", "tp2"), ("cp2_pp2_vpp2", "pp2_vpp2")):
        assert (lays[a]["logits_raw"] - lays[b]["logits_raw"]).abs().max() <= 1e-5, (a, b)
        ga, gb = ({n: g for rk in ranks for n, g in rk["layouts"][k]["grads_raw"].items()} for k in (a, b))
        assert set(ga) == set(gb)
        assert max((ga[n] - gb[n]).abs().max().item() for n in ga) <= 1e-5, (a, b)
    # HF -> megatron (PP2 x VPP2 chunks) -> HF is bit-exact (each stage exports its own chunks).
    from safetensors.torch import load_file
    hf = load_file(os.path.join(qwen2, "model.safetensors"))
    exported = {}
    for rk in ranks:
        exported.update(rk["layouts"]["pp2_vpp2"]["export"])
    assert sorted(exported) == sorted(hf)
    assert all(torch.equal(exported[n], hf[n]) for n in hf)
    # The per-chunk checkpoint resumes under other layouts: same policy, same next step.
    vpp = lays["pp2_vpp2"]
    for key in ("tp2_sp_cp2",):
        loaded, after = out[f"resume_{key}"]
        assert (loaded - vpp["lp_saved"]).abs().max() < 1e-5, key
        assert (after - vpp["lp_after"]).abs().max() < 1e-5, key
