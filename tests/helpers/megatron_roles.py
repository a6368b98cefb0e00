"""The megatron roles' shared test pieces: batches, losses, transformers references, and an
actor at any layout (tests/test_models_distributed.py, test_models_moe.py, test_parallel_layouts.py,
test_packing_distributed.py, test_checkpoint_tools.py)."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from megarl.models.tiny import token_rows
from megarl.parallel import state
from megarl.protocol import DataProto
from megarl.workers.actor import ActorWorker
from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig

TEMP = 0.7
TOL = 1e-4


def make_batch(vocab: int, B: int = 8, R: int = 6, seed: int = 0, *, prompts: tuple[int, int] = (2, 7),
               min_response: int = 1, pad: int = 2, targets: bool = True) -> DataProto:
    """Right-padded prompt+response rows of different lengths (prompt lengths in [prompts[0],
    prompts[1]), responses in [min_response, R]) and, with `targets`, advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(*prompts, (B,), generator=g)
    rlen = torch.randint(min_response, R + 1, (B,), generator=g)
    rows = token_rows(plen, rlen, R, vocab, g, pad=pad)
    if targets:
        rows.update(advantages=torch.randn(B, R, generator=g), returns=torch.randn(B, R, generator=g))
    return DataProto.from_dict(rows)


def policy_loss(out, mb):
    """A token-mean policy-gradient loss with an entropy bonus, normalised over the mini-batch."""
    m = mb.batch["response_mask"]
    loss = ((-(out["log_probs"] * mb.batch["advantages"]) - 0.01 * out["entropy"]) * m).sum()
    loss = loss / mb.meta_info["global_tokens"]
    # Metrics are averaged over micro-batches; a share times their count averages to the exact total.
    return loss, {"actor/pg_loss": loss.detach() * mb.meta_info["global_micro_batches"]}


def value_loss(out, mb):
    m = mb.batch["response_mask"]
    loss = (((out["values"] - mb.batch["returns"]) ** 2) * m).sum() / mb.meta_info["global_tokens"]
    return loss, {"critic/vf_loss": loss.detach() * mb.meta_info["global_micro_batches"]}


def nan_loss(out, mb):
    loss, metrics = policy_loss(out, mb)
    return loss * float("nan"), metrics


# -- transformers references (parent process) ---------------------------------------------------------------
def _positions(data: DataProto, R: int, S: int) -> torch.Tensor:
    return (data.batch["prompt_lens"][:, None] - 1 + torch.arange(R)).clamp(max=S - 1)


def hf_policy_backward(logits: torch.Tensor, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs and entropies from an HF model's full-sequence `logits` at
    TEMP, after backpropagating policy_loss through them (the oracle side of the parity tests)."""
    R, S = data.batch["responses"].shape[1], logits.shape[1]
    picked = (logits / TEMP).gather(1, _positions(data, R, S)[..., None].expand(-1, -1, logits.shape[-1]))
    lsm = picked.log_softmax(-1)
    mask = data.batch["response_mask"]
    lp = lsm.gather(-1, data.batch["responses"][..., None]).squeeze(-1) * mask
    ent = -(lsm.exp() * lsm).sum(-1) * mask
    data.meta_info.update(global_tokens=float(mask.sum()), global_micro_batches=1)
    loss, _ = policy_loss({"log_probs": lp, "entropy": ent}, data)
    loss.backward()
    return lp, ent


def hf_actor_reference(path: str, data: DataProto) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = model(data.batch["input_ids"]).logits
    lp, ent = hf_policy_backward(logits, data)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return {"logits": logits.detach(), "log_probs": lp.detach(), "entropy": ent.detach(), "grads": grads,
            "grad_norm": norm}


def hf_critic_reference(path: str, data: DataProto) -> dict:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    ids = data.batch["input_ids"]
    hidden = model.model(ids).last_hidden_state
    per_pos = model.score(hidden)[..., 0]  # [B, S]
    R = data.batch["responses"].shape[1]
    mask = data.batch["response_mask"]
    values = per_pos.gather(1, _positions(data, R, ids.shape[1])) * mask
    data.meta_info.update(global_tokens=float(mask.sum()), global_micro_batches=1)
    last = data.batch["prompt_lens"] + data.batch["response_lens"] - 1
    scores = per_pos.gather(1, last[:, None]).squeeze(1)  # a reward model reads the last token
    loss, _ = value_loss({"values": values}, data)
    loss.backward()
    return {"values": values.detach(), "scores": scores.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}




def make_actor(path: str, micro: int, *, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None,
               sp: bool | None = None, ep: int = 1, override: dict | None = None, lora: dict | None = None,
               **optim) -> ActorWorker:
    """An ActorWorker at layout TP x CP x PP (VPP, SP, EP), mini-batch 8, lr 1e-3 unless `optim` says."""
    mc = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, expert_model_parallel_size=ep)
    # entropy_coeff: policy_loss has an entropy bonus, so the entropy must carry gradients.
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro, megatron=mc, entropy_coeff=0.01,
                      optim=OptimConfig(**{"lr": 1e-3, **optim}))
    state.init_distributed()   # the rank set-up; the engine starts no process group
    return ActorWorker(ModelConfig(path=path, override_config=dict(override or {}), **(lora or {})), cfg)


def grad_errors(engine, ref_grads) -> tuple[float, set]:
    worst, seen = 0.0, set()
    for name, g in engine.hf_grads():
        seen.add(name)
        worst = max(worst, (g.cpu() - ref_grads[name]).abs().max().item())
    return worst, seen


def diff(a, b) -> float:
    return (a.cpu() - b).abs().max().item()


def assert_same_tensors(a: str, b: str) -> None:
    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name
