"""The issue's criterion end to end: the native engine's reported log-probs equal the megatron
actor's compute_log_prob on the same tokens after a weight sync, on 2 real gloo ranks.

Actor at TP=2 (megatron-core, built from a tiny HF checkpoint); the engine at rollout TP=2 on the
same ranks, starting without weights (load_format=dummy). Each step: actor.hf_tensors() streamed
in buckets -> finalize -> generate_sequences -> actor.compute_log_prob on the packed batch ->
compare on response_mask -> update_policy moves the weights for the next step.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.rollout.fixtures import PARITY_PROMPTS, PARITY_TEMPERATURE, policy_loss

PROMPTS, TEMP, _policy_loss = PARITY_PROMPTS, PARITY_TEMPERATURE, policy_loss


def _steps(rank, world, path):
    from megarl.parallel import state
    from megarl.protocol import DataProto
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.hf_weights import buckets
    from megarl.rollout.registry import build_rollout
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig

    state.init_distributed()   # the rank set-up; the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path), ActorConfig(
        ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, megatron=MegatronConfig(tensor_model_parallel_size=2),
        optim=OptimConfig(lr=3e-2)))
    engine = build_rollout(RolloutConfig(tensor_model_parallel_size=2), path, tp_group=state.tp_group())
    errors, tokens = [], []
    for step in range(3):
        for bucket in buckets(actor.hf_tensors(), bucket_bytes=64 << 10):
            engine.update_weights(bucket)
        engine.finalize_weights()
        sp = SamplingParams(n=2, max_tokens=8, temperature=TEMP, top_p=0.9, seed=step)
        batch = engine.generate_sequences(DataProto(non_tensor_batch={"prompt_token_ids": PROMPTS},
                                                    meta_info={"sampling": sp}))
        log_probs, _ = actor.compute_log_prob(batch, temperature=TEMP, with_entropy=False)
        mask = batch.batch["response_mask"].bool()
        errors.append((log_probs.cpu() - batch.batch["rollout_log_probs"])[mask].abs().max().item())
        tokens.append(batch.batch["responses"].tolist())
        batch.batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None].expand_as(log_probs).contiguous()
        actor.update_policy(batch, _policy_loss, TEMP)
    state.destroy_model_parallel()
    return errors, tokens


@pytest.mark.timeout(400)
def test_rollout_log_probs_equal_the_actors_after_each_sync(tmp_path):
    from megarl.models.tiny import make_tiny_hf
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2", seed=1, vocab_size=301)
    (err0, tok0), (err1, tok1) = run_ranks(2, _steps, (path,))
    assert tok0 == tok1, "the rollout TP ranks sampled different tokens"
    assert tok0[0] != tok0[1], "update_policy did not move the weights"
    print("max |rollout log-prob - actor compute_log_prob| per step:", ", ".join(f"{e:.2e}" for e in err0))
    assert max(err0 + err1) <= 1e-5
