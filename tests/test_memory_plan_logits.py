"""The memory plan's last pipeline stage: the LM head and the loss (memory_terms.logits_bytes)
against the bytes torch allocates running megarl's own log-prob path (workers/logprob.py) forward
and backward on CPU, read from torch.profiler's allocation records; and the plan per stage.

    python -m pytest -q tests/test_memory_plan_logits.py
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from megarl.experiment import load_config
from megarl.launcher.memory_plan import DEVICE_MEMORY_ENV, memory_plan
from megarl.launcher.memory_terms import Layout, activation_bytes, logit_chunk_tokens, logits_bytes
from megarl.models.spec import ModelSpec
from megarl.workers.logprob import chunk_tokens, linear_log_probs
from tests.helpers.real_models import ASSETS, ROOT, SEVEN_B, SEVEN_B_CONFIG, seven_b

# A vocabulary wide enough that megarl's own chunking (64 MiB of fp32 logits) cuts 600 tokens in 3.
VOCAB, HIDDEN, SCORED = 65_500, 32, 600


def _spec() -> ModelSpec:
    hf = transformers.AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                           tie_word_embeddings=False).to_dict()
    return ModelSpec.from_hf_config({**hf, "architectures": ["Qwen2ForCausalLM"]})


def _peak_bytes(spec: ModelSpec, dtype: torch.dtype, temperature: float, entropy_grad: bool) -> int:
    """The most bytes live at once beyond the inputs (the final hidden states, the head weight with
    its padded rows): the scored positions gathered, log-probs and entropy, a loss on both, backward."""
    g = torch.Generator().manual_seed(0)
    rows = spec.padded_vocab(1)
    hidden = torch.randn(SCORED, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(rows, HIDDEN, generator=g) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (SCORED,), generator=g)
    order, g_lp, g_ent = torch.randperm(SCORED, generator=g), torch.randn(SCORED), torch.randn(SCORED)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        picked = hidden[order]                      # workers/outputs.py: a copy at the response positions
        lp, ent = linear_log_probs(picked, weight, targets, 0, VOCAB, None, temperature, True, entropy_grad)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0)
        loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_the_plan_chunks_as_the_log_prob_path_does():
    for vocab in (1, 1000, 65_500, 152_064 // 4, 152_064):
        assert logit_chunk_tokens(vocab) == chunk_tokens(vocab), vocab


@pytest.mark.parametrize("dtype, temperature, entropy_grad", [
    (torch.float32, 1.0, False), (torch.float32, 0.7, True), (torch.bfloat16, 0.7, False), (torch.bfloat16, 1.0, True)])
def test_logits_term_is_what_torch_allocates(dtype, temperature, entropy_grad):
    """Every [chunk, V], [V, h] and [tokens, h] tensor and the 4 fp32 numbers a token are planned;
    the rest is the per-chunk and per-token vectors the plan leaves out (row maxima, sums, gather
    indices, the loss's gradients): under 24 bytes a chunk row and 16 a token."""
    spec = _spec()
    chunk = chunk_tokens(VOCAB)
    assert SCORED // chunk == 2 and SCORED % chunk                # 3 chunks, the last one short
    nbytes = 4 if dtype == torch.float32 else 2
    planned = logits_bytes(spec, Layout(param_bytes=nbytes), SCORED, nbytes, temperature, entropy_grad)
    measured = _peak_bytes(spec, dtype, temperature, entropy_grad)
    assert 0 <= measured - planned <= 24 * chunk + 16 * SCORED, (measured, planned)


def test_activation_bytes_per_stage():
    """1F1B: stage p of PP holds its layers for min(PP - p, micro-batches) micro-batches."""
    spec = ModelSpec.from_hf_config(seven_b())
    s = 4096
    stage0 = activation_bytes(spec, Layout(pp=4), s, 8)
    assert [activation_bytes(spec, Layout(pp=4), s, 8, pp_rank=p) for p in range(4)] == \
        [stage0, stage0 * 3 // 4, stage0 // 2, stage0 // 4]
    assert activation_bytes(spec, Layout(pp=4), s, 2, pp_rank=1) == stage0 // 2     # two micro-batches only


def test_the_last_stage_plans_the_logits_and_the_largest_stage_is_named(monkeypatch, capsys):
    """The shipped 7B config at PP 2: the last stage carries the LM head's chunks and the fp32 head
    gradient (152k rows), stage 0 the embedding and the most micro-batches in flight."""
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "80")
    cfg = load_config(os.path.join(ROOT, "configs", SEVEN_B_CONFIG), [
        f"actor_rollout_ref.model.path={ASSETS}/{SEVEN_B}", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
    plan = memory_plan(cfg, seven_b())
    first, last = [r for r in plan.rows if r.role == "actor"]
    assert (first.stage, last.stage) == ("pp stage 0", "pp stage 1")
    lay = Layout(tp=4, pp=2, param_bytes=2)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    tokens = (cfg.actor.ppo_max_token_len_per_gpu if cfg.actor.use_dynamic_bsz
              else cfg.actor.ppo_micro_batch_size_per_gpu * seq)
    scored = tokens * cfg.data.max_response_length // seq
    assert first.logits == 0 and last.logits == logits_bytes(
        ModelSpec.from_hf_config(seven_b()), lay, scored, 2, cfg.rollout.temperature, cfg.actor.entropy_coeff != 0)
    assert last.logits > 152_064 // 4 * 3584 * 4                   # at least the head's fp32 gradient
    assert 0 < last.activations < first.activations
    terms = plan.train_terms([r for r in plan.rows if r.stage == "pp stage 1"])
    assert terms["actor logits"] == last.logits
    stage, need = plan.largest()
    assert need == max(sum(plan.train_terms([r for r in plan.rows if r.stage == s]).values())
                       for s in ("pp stage 0", "pp stage 1"))
    assert f"  largest: {stage}, training " in plan.render()
