"""megarl's megatron roles on real megatron-core and 4 real gloo ranks, with transformers as the
oracle. One spawn walks the layouts (TP, PP, DP) = (2,2,1), (2,1,2), (1,2,2), (1,1,4) for a
Qwen2 model (QKV bias, untied head, GQA 4/2, vocab 301 not divisible by TP) and a Llama model
(tied embeddings, GQA) and checks, per layout: logits, compute_log_prob and entropy, the
accumulated gradient of a loss against transformers' autograd (micro-batch sizes 1, 2 and 4 at
DP 1, 2 and 4: the gradient contract), and one update_policy. The same spawn checks the critic
(values and gradients of a reward-model init, zero head from an actor init), the reference,
NaN-step skipping, a checkpoint saved at TP2xPP2 resumed at TP1xPP2 (model, optimizer, LR), and
a reference loaded from that distributed checkpoint alone.
"""
from __future__ import annotations

import os

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import (TEMP, TOL, assert_same_tensors, diff, grad_errors, hf_actor_reference,
                                          hf_critic_reference, make_actor, make_batch, nan_loss, policy_loss,
                                          value_loss)

LAYOUTS = [(2, 2, 1), (2, 1, 2), (1, 2, 4), (1, 1, 2)]  # (TP, PP, micro-batch); DP = 4 / (TP x PP)
# -- the spawned checks ---------------------------------------------------------------------------------------
def check_roles(rank, world, models: dict, refs: dict, rm_path: str, ckpt_dir: str):
    from megarl.parallel import cpu_compat, state
    from megarl.workers.config import CriticConfig, CriticModelConfig, MegatronConfig, ModelConfig, RefConfig
    from megarl.workers.critic import CriticWorker
    from megarl.workers.outputs import value_outputs
    from megarl.workers.reference import ReferenceWorker

    out: dict = {"layouts": {}}
    for family, path in models.items():
        ref = refs[family]
        data = make_batch(ref["logits"].shape[-1])
        for tp, pp, micro in LAYOUTS:
            actor = make_actor(path, micro, tp=tp, pp=pp)
            r = {"logits": diff(actor.engine.logits(data.batch["input_ids"], micro), ref["logits"])}
            lp, ent = actor.compute_log_prob(data, TEMP)
            r["log_probs"], r["entropy"] = diff(lp, ref["log_probs"]), diff(ent, ref["entropy"])
            actor.engine.accumulate(data, micro, actor._process(TEMP, True, True), policy_loss)
            r["grad"], r["grad_names"] = grad_errors(actor.engine, ref["grads"])
            r["metrics"] = actor.update_policy(data, policy_loss, TEMP)
            r["moved"] = diff(actor.compute_log_prob(data, TEMP)[0], ref["log_probs"])
            out["layouts"][(family, tp, pp, micro)] = r
            del actor
            state.destroy_model_parallel()
    out["shim_active"] = cpu_compat.active()
    with cpu_compat.scope():  # megatron's CUDA literals map to CPU inside the scope only
        out["scoped_device"] = str(torch.zeros(1, device="cuda").device)
    try:
        torch.zeros(1, device="cuda")
        out["unscoped"] = "mapped"
    except (RuntimeError, AssertionError):
        out["unscoped"] = "refused"

    # Critic, reference, NaN skip and checkpoint resume on the Qwen2 model, at TP2 x PP2.
    path = models["qwen2"]
    data = make_batch(refs["qwen2"]["logits"].shape[-1])
    layout = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    critic = CriticWorker(CriticConfig(model=CriticModelConfig(path=rm_path, init_from="path"), megatron=layout,
                                       ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2))
    out["values"] = diff(critic.compute_values(data), refs["critic"]["values"])
    critic.engine.accumulate(data, 2, value_outputs, value_loss)
    out["critic_grad"], out["critic_grad_names"] = grad_errors(critic.engine, refs["critic"]["grads"])
    losses = [critic.update_critic(data, value_loss)["critic/vf_loss"] for _ in range(3)]
    out["critic_losses"] = losses
    del critic
    from megarl.workers.reward_model import RewardModelWorker
    rm = RewardModelWorker(ModelConfig(path=rm_path), CriticConfig(megatron=layout), actor_vocab=301,
                           micro_batch_size=2)
    out["rm_scores"] = diff(rm.compute_scores(data), refs["critic"]["scores"])
    del rm
    fresh = CriticWorker(CriticConfig(model=CriticModelConfig(path=path, init_from="actor"), megatron=layout,
                                      ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2))
    out["fresh_values"] = fresh.compute_values(data).abs().max().item()
    fresh_rm = CriticWorker(CriticConfig(model=CriticModelConfig(path=rm_path, init_from="path"), megatron=layout,
                                         ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2))
    fresh_rm.save_checkpoint(os.path.join(ckpt_dir, "critic"))
    del fresh, fresh_rm

    refw = ReferenceWorker(ModelConfig(path=path), RefConfig(megatron=layout, param_offload=True), micro_batch_size=2)
    out["ref"] = diff(refw.compute_ref_log_prob(data, TEMP), refs["qwen2"]["log_probs"])
    del refw

    actor = make_actor(path, 2, tp=2, pp=2, lr_decay_style="linear", lr_decay_steps=4)
    before = actor.compute_log_prob(data, TEMP)[0]
    skipped = actor.update_policy(data, nan_loss, TEMP)
    out["nan_skipped"] = skipped["actor/skipped_steps"]
    out["nan_unchanged"] = diff(actor.compute_log_prob(data, TEMP)[0], before)
    actor.update_policy(data, policy_loss, TEMP)
    saved_lp = actor.compute_log_prob(data, TEMP)[0]
    actor.save_checkpoint(os.path.join(ckpt_dir, "actor"))
    from megatron.core import dist_checkpointing
    out["content_metadata"] = dist_checkpointing.load_content_metadata(os.path.join(ckpt_dir, "actor"))
    m2 = actor.update_policy(data, policy_loss, TEMP)
    after_two = actor.compute_log_prob(data, TEMP)[0]
    del actor
    state.destroy_model_parallel()
    resumed = make_actor(path, 4, tp=1, pp=2, lr_decay_style="linear", lr_decay_steps=4)
    resumed.load_checkpoint(os.path.join(ckpt_dir, "actor"))
    m2b = resumed.update_policy(data, policy_loss, TEMP)
    out["resume"] = (diff(resumed.compute_log_prob(data, TEMP)[0], after_two), m2["actor/lr"], m2b["actor/lr"])
    del resumed
    # A reference built from the distributed checkpoint alone (megatron.dist_checkpointing_path).
    from_ckpt = ReferenceWorker(ModelConfig(path=None), RefConfig(megatron=MegatronConfig(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
        dist_checkpointing_path=os.path.join(ckpt_dir, "actor"))), micro_batch_size=4)
    out["from_dist_ckpt"] = diff(from_ckpt.compute_ref_log_prob(data, TEMP), saved_lp.cpu())
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": make_tiny_hf(str(root / "qwen2"), "qwen2", seed=1, vocab_size=301),
        "llama": make_tiny_hf(str(root / "llama"), "llama", seed=2, vocab_size=301, tie_word_embeddings=True,
                              rope_theta=50000.0),
        "rm": make_tiny_hf(str(root / "rm"), "qwen2", seed=3, vocab_size=301, score_head=True),
    }


@pytest.mark.timeout(900)
def test_roles_match_transformers_on_every_layout(tiny_models, tmp_path):
    models = {k: tiny_models[k] for k in ("qwen2", "llama")}
    refs = {f: hf_actor_reference(p, make_batch(301)) for f, p in models.items()}
    refs["critic"] = hf_critic_reference(tiny_models["rm"], make_batch(301))
    out = run_ranks(4, check_roles, (models, refs, tiny_models["rm"], str(tmp_path)))
    ranks = out
    out = out[0]
    assert out["shim_active"] and out["scoped_device"] == "cpu" and out["unscoped"] == "refused"
    for key, r in out["layouts"].items():
        assert r["logits"] < TOL and r["log_probs"] < TOL and r["entropy"] < TOL, (key, r)
        assert r["grad"] < 1e-5, (key, r["grad"])
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(refs[key[0]]["grad_norm"], rel=1e-5), key
        assert r["metrics"]["actor/lr"] == 1e-3 and r["metrics"]["actor/skipped_steps"] == 0
        assert r["moved"] > 1e-3, key  # the update changed the policy
        covered = set().union(*(rk["layouts"][key]["grad_names"] for rk in ranks))
        assert covered == set(refs[key[0]]["grads"]), key
    # Same loss reported whatever the micro-batching and DP size (share x micro-batch count, averaged).
    pg = [r["metrics"]["actor/pg_loss"] for k, r in out["layouts"].items() if k[0] == "qwen2"]
    assert max(pg) - min(pg) < 1e-5, pg
    assert out["values"] < TOL and out["critic_grad"] < 1e-5
    assert out["rm_scores"] < TOL   # reward model at TP2 x PP2 vs transformers' score head
    assert set().union(*(rk["critic_grad_names"] for rk in ranks)) == set(refs["critic"]["grads"])
    assert out["critic_losses"][2] < out["critic_losses"][0]
    assert out["fresh_values"] == 0.0
    assert out["ref"] < TOL
    assert out["nan_skipped"] == 1.0 and out["nan_unchanged"] == 0.0
    assert out["from_dist_ckpt"] < 1e-5
    # the distributed optimizer's layout megatron-core 0.16 accepts (its default it refuses on save)
    assert out["content_metadata"] == {"distrib_optim_sharding_type": "fully_reshardable"}
    diff, lr_saved, lr_resumed = out["resume"]
    assert diff < 1e-5 and lr_saved == lr_resumed == pytest.approx(1e-3 * 0.5)
    # The untrained critic's checkpoint exports back to the reward model's own tensors, bit for bit.
    from checkpoints_tools.megatron_to_hf import export
    export(str(tmp_path / "critic"), str(tmp_path / "critic_hf"), trust_unsealed=True)
    assert_same_tensors(tiny_models["rm"], str(tmp_path / "critic_hf"))


