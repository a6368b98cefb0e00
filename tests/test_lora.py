"""LoRA on megatron shards (megarl/models/lora.py) with transformers + PEFT as the oracle. One
spawn of 2 gloo ranks walks TP2 and PP2 for a Qwen2 model (GQA 4/2, QKV bias, SwiGLU) with
adapters on every linear (fused QKV and gate/up included) and checks, per layout:
  - the same base and adapter weights give PEFT's logits and PEFT's adapter gradients (fp32);
  - fresh adapters (B = 0) give the base's logits exactly, and only adapter parameters require
    gradients or sit in the optimizer; an update moves the adapters and leaves the base bit-equal;
  - the reference is the actor's own base (adapters off): its log-probs are the base model's;
  - what a weight sync reads (ShardSource) is W + scale B A, against PEFT's fp32 merge, and after a
    colocated sync the native engine's sampled log-probs are the adapted actor's, and a delta
    sync after an update (disk transport) reads back as the merged export bit for bit;
  - at TP2 a checkpoint resumes the adapters and optimizer exactly, is refused by a run without
    LoRA, and exports a merged HF model and a PEFT adapter directory that give the actor's logits.

    python -m pytest -q tests/test_lora.py
"""
from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from megarl.config.errors import ConfigError
from megarl.experiment import load_config
from megarl.models.tiny import make_tiny_hf
from megarl.workers.actor import converter_config
from megarl.workers.config import ModelConfig
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import TEMP, diff, hf_policy_backward, make_actor, make_batch, policy_loss

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}
LAYOUTS = [(2, 1), (1, 2)]   # (TP, PP) on 2 ranks
TOL = 1e-5


def peft_reference(path: str, data, out: str) -> dict:
    """PEFT's logits, adapter gradients and merged weights for random adapters (saved to `out`)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapters = {n.replace(".default", ""): p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}
    save_file(adapters, out)
    ids = data.batch["input_ids"]
    logits = pm(ids).logits
    hf_policy_backward(logits, data)
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n}
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
        merged = {n: p.clone() for n, p in pm.merge_and_unload().state_dict().items()}
    return {"logits": logits.detach(), "grads": grads, "merged": merged, "base_logits": base_logits}


def check_lora(rank, world, path: str, adapter_file: str, ref: dict, ckpt_dir: str):
    from safetensors.torch import load_file

    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.experiment import load_config
    from megarl.checkpoint_engine.disk_delta import read_weights
    from tests.helpers.checkpoint_engine import full_export, native_engine, rollout_groups, rollout_vs_actor
    from megarl.models import lora
    from megarl.models.convert import assemble, hf_slices
    from megarl.parallel import state
    from megarl.workers.config import RefConfig
    from megarl.workers.reference import ReferenceWorker

    tensors = load_file(adapter_file)
    data = make_batch(ref["logits"].shape[-1])
    out = {}
    for tp, pp in LAYOUTS:
        r = {}
        actor = make_actor(path, 2, tp=tp, pp=pp, lora=LORA)
        eng = actor.engine
        ids = data.batch["input_ids"]
        # fresh adapters: B = 0 gives the base exactly
        fresh = eng.logits(ids, 2)
        with lora.disabled(eng.models):
            r["fresh_exact"] = torch.equal(fresh, eng.logits(ids, 2))
        r["fresh_vs_hf"] = diff(fresh, ref["base_logits"])
        adapters = {id(p) for a in lora.adapters(eng.models) for p in a.parameters()}
        in_optim = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
        trainable = {id(p) for p in eng.parameters() if p.requires_grad}
        r["only_adapters_train"] = bool(adapters) and trainable == adapters and in_optim <= adapters
        lora.load_peft(eng.models, tensors)
        r["logits"] = diff(eng.logits(ids, 2), ref["logits"])
        # a colocated sync to the native engine: it samples with the adapted policy's log-probs
        group = rollout_groups(1)
        engine = native_engine(path, group)
        cfg = load_config(None, [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=2",
                                 f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                                 f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                                 "actor_rollout_ref.model.lora_rank=4"])
        build_checkpoint_engine(cfg, actor, engine, group).sync()
        r["sync_logprob"] = rollout_vs_actor(engine, actor)[0]
        del engine
        eng.accumulate(data, 2, actor._process(TEMP, True, True), policy_loss)
        got = dict(lora.peft_tensors(eng.models, lambda p: p.main_grad))
        r["grad_names"] = set(got)
        r["grad"] = max(diff(g, ref["grads"][n]) for n, g in got.items())
        # the reference: the actor's base, adapters off
        refw = ReferenceWorker.base_of(actor, RefConfig(), 2)
        base_lp = refw.compute_ref_log_prob(data, TEMP)
        with lora.disabled(eng.models):
            r["ref_is_base"] = torch.equal(base_lp, actor.compute_log_prob(data, TEMP)[0])
        r["ref_differs_from_actor"] = diff(base_lp, actor.compute_log_prob(data, TEMP)[0]) > 1e-3
        # weight sync reads merged shards: W + scale B A against PEFT's fp32 merge
        src = ShardSource.from_actor(actor)
        worst, merged_names = 0.0, 0
        for name in src.params.computed:       # the entries read merged (converters.ExportedParams)
            pieces = {s.hf_name: s.take(ref["merged"][s.hf_name]) for s in hf_slices(name, actor.spec, src.tp_rank, tp)}
            worst = max(worst, diff(src.params[name], assemble(name, pieces, actor.spec, src.tp_rank, tp)))
            merged_names += 1
        r["merge"], r["merged_names"] = worst, merged_names
        r["hf_export"] = max(diff(t, ref["merged"][n]) for n, t in eng.hf_tensors())
        # one update moves the adapters only
        before = {n: p.detach().clone() for n, p in eng.named_global_parameters()}
        adapters_before = [p.detach().clone() for a in lora.adapters(eng.models) for p in a.parameters()]
        actor.update_policy(data, policy_loss, TEMP)
        r["base_unchanged"] = all(torch.equal(before[n], p) for n, p in eng.named_global_parameters())
        r["adapters_moved"] = any(not torch.equal(b, p) for b, p in
                                  zip(adapters_before, [p for a in lora.adapters(eng.models) for p in a.parameters()]))
        # delta sync on top (disk transport): an anchor, one more update, a delta holding the merged
        # rows that changed; the chain read back equals the merged export bit for bit
        disk_dir = f"{ckpt_dir}-weights-{tp}x{pp}"
        dcfg = load_config(None, [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=2",
                                  f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                                  f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                                  "actor_rollout_ref.model.lora_rank=4",
                                  "actor_rollout_ref.rollout.checkpoint_engine.backend=disk",
                                  f"actor_rollout_ref.rollout.checkpoint_engine.disk_dir={disk_dir}",
                                  "actor_rollout_ref.rollout.checkpoint_engine.delta=on"])
        disk = build_checkpoint_engine(dcfg, actor)
        first = disk.sync()
        actor.update_policy(data, policy_loss, TEMP)
        second = disk.sync()
        expected = full_export(actor)
        got = read_weights(disk_dir)
        r["delta"] = (first["weight_sync/anchor"], second["weight_sync/anchor"], sorted(got) == sorted(expected),
                      all(torch.equal(got[n], expected[n].to(got[n].dtype)) for n in expected if n in got))
        out[(tp, pp)] = r
        del actor, refw, src, disk
        state.destroy_model_parallel()
    out["checkpoint"] = check_resume(rank, path, tensors, data, ckpt_dir)
    return out


def check_resume(rank, path: str, tensors: dict, data, ckpt_dir: str) -> dict:
    """At TP2: a saved actor's adapters and optimizer resume exactly; the checkpoint exports."""
    import sys

    from megarl.models import lora
    from megarl.parallel import state
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from checkpoints_tools.megatron_to_hf import export

    ids, r = data.batch["input_ids"], {}
    a = make_actor(path, 2, tp=2, lora=LORA)
    lora.load_peft(a.engine.models, tensors)
    a.update_policy(data, policy_loss, TEMP)
    a.engine.save_checkpoint(ckpt_dir)
    r["saved_logits"] = a.engine.logits(ids, 2)
    a.update_policy(data, policy_loss, TEMP)
    after = a.engine.logits(ids, 2)
    del a
    state.destroy_model_parallel()
    b = make_actor(path, 2, tp=2, lora=LORA)
    b.engine.load_checkpoint(ckpt_dir)
    r["resumed_exact"] = torch.equal(b.engine.logits(ids, 2), r["saved_logits"])
    b.update_policy(data, policy_loss, TEMP)
    r["step_after_resume_exact"] = torch.equal(b.engine.logits(ids, 2), after)
    del b
    state.destroy_model_parallel()
    try:
        make_actor(path, 2, tp=2).engine.load_checkpoint(ckpt_dir)
    except ValueError as err:
        r["no_lora_refused"] = str(err)
    state.destroy_model_parallel()
    out = os.path.join(os.path.dirname(ckpt_dir), f"export{rank}")
    export(ckpt_dir, os.path.join(out, "merged"), "float32", os.path.join(out, "adapter"), trust_unsealed=True)
    r["export"] = out
    return r


def test_lora_matches_peft_at_tp2_and_pp2(tmp_path):
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", tokenizer=False, num_hidden_layers=2)
    data = make_batch(AutoModelForCausalLM.from_pretrained(path).config.vocab_size)
    ref = peft_reference(path, data, str(tmp_path / "adapter.safetensors"))
    results = run_ranks(2, check_lora, (path, str(tmp_path / "adapter.safetensors"), ref, str(tmp_path / "ckpt")))
    for layout in LAYOUTS:
        names = set().union(*(res[layout]["grad_names"] for res in results))
        assert names == set(ref["grads"]), layout           # every PEFT adapter, across the stages
        for res in results:
            r = res[layout]
            assert r["fresh_exact"] and r["fresh_vs_hf"] < 1e-4, (layout, r)
            assert r["only_adapters_train"], layout
            assert r["logits"] <= TOL and r["grad"] <= TOL, (layout, r["logits"], r["grad"])
            assert r["ref_is_base"] and r["ref_differs_from_actor"], layout
            assert r["merged_names"] > 0 and r["merge"] <= 1e-6, (layout, r["merge"])
            assert r["sync_logprob"] <= TOL and r["hf_export"] <= 1e-6, (layout, r["sync_logprob"], r["hf_export"])
            assert r["base_unchanged"] and r["adapters_moved"], layout
            assert r["delta"] == (1.0, 0.0, True, True), (layout, r["delta"])
    ck = results[0]["checkpoint"]
    assert ck["resumed_exact"] and ck["step_after_resume_exact"]
    assert "saved with LoRA {'rank': 4" in ck["no_lora_refused"] and "\n" not in ck["no_lora_refused"]
    # the exports: a merged HF model, and a PEFT adapter directory PEFT loads on the base
    ids = data.batch["input_ids"]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(ck["export"], "merged"), dtype=torch.float32)(ids)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, os.path.join(ck["export"], "adapter"))(ids)
    assert diff(merged.logits, ck["saved_logits"]) <= TOL
    assert diff(peft.logits, ck["saved_logits"]) <= TOL


def test_lora_keys_refused_in_one_line():
    with pytest.raises(ConfigError, match="target_modules") as err:
        ModelConfig(path="x", lora_rank=4, target_modules=["lm_head"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="lora_rank"):
        ModelConfig(path="x", lora_rank=4, lora_dropout=1.0)
    assert converter_config(ModelConfig(path="x", lora_rank=2, target_modules=["linear_qkv", "o_proj"]))["lora"] == {
        "rank": 2, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}
    assert "lora" not in converter_config(ModelConfig(path="x"))


def test_lora_combinations_refused_in_one_line(tmp_path):
    on = ["actor_rollout_ref.model.lora_rank=4"]
    cfg = load_config(None, on)
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    assert load_config(str(tmp_path / "c.yaml")).model.lora_rank == 4        # a run's written config reloads
    for extra, key in ((["actor_rollout_ref.ref.param_offload=true"], "actor_rollout_ref.ref.param_offload"),
                       (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"],
                        "actor_rollout_ref.ref.megatron"),
                       (["critic.model.lora_rank=4"], "critic.model.lora_rank"),
                       (["actor_rollout_ref.model.lora.rank=8"], "actor_rollout_ref.model.lora.rank")):
        with pytest.raises(ConfigError) as err:
            load_config(None, on + extra)
        assert str(err.value).startswith(key + ":") and "\n" not in str(err.value), err.value
