"""Packed (THD) and token-budget micro-batches equal the padded path, on 4 real gloo ranks.

    python -m pytest -q tests/test_packing_distributed.py

One spawn walks TP2 x PP2 (PP needs a fixed shape between stages: packed micro-batches padded
to a common length) and DP4 (token-budget plans agree across DP ranks). On one engine per layout,
the padded path with static
micro-batches is the baseline; packed static, packed by a token budget and padded by a token
budget must give the same log-probs, entropy and accumulated gradients (fp32, <= 1e-5). The same
for the critic's values and gradients, and, under TP2 where the vocabulary is split, the lean
log-prob (LM head applied chunk by chunk) against the materialised logits. Transformers-level
exactness of the packed default is tests/test_models_distributed.py.
"""
from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import make_batch, policy_loss, value_loss

TEMP = 0.7
MODES = [("packed", None), ("packed", 24), ("padded", 30)]  # (layout, token budget); baseline: padded, None
# Padded micro-batches by a token budget vary in rows, which a pipeline cannot carry (refused).


def _grads(engine) -> dict:
    return {n: g.cpu() for n, g in engine.hf_grads()}


def _run_modes(engine, data, forward, train, keys):
    out = {}
    for layout, budget in [("padded", None)] + MODES:
        if layout == "padded" and budget and engine.layout.pp > 1:
            continue
        engine.schedule.packed = layout == "packed"
        engine.take_padding()
        rows = engine.forward_rows(data, 2, forward, keys, max_tokens=budget)
        engine.accumulate(data, 2, train, policy_loss if "log_probs" in keys else value_loss, max_tokens=budget)
        out[(layout, budget)] = (rows, _grads(engine), engine.take_padding())
    return out


def _worst(out) -> dict:
    base_rows, base_grads, _ = out[("padded", None)]
    worst = {}
    for mode, (rows, grads, tokens) in out.items():
        d_rows = max((rows[k] - base_rows[k]).abs().max().item() for k in rows)
        d_grads = max((grads[n] - base_grads[n]).abs().max().item() for n in base_grads)
        worst[mode] = (d_rows, d_grads, tokens)
    return worst


def check_packing(rank, world, path, rm_path):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import (ActorConfig, CriticConfig, CriticModelConfig, MegatronConfig, ModelConfig,
                                       OptimConfig)
    from megarl.workers.critic import CriticWorker
    from megarl.workers.logprob import linear_log_probs, token_log_probs
    from megarl.workers.outputs import value_outputs

    state.init_distributed()   # the rank set-up; the engine starts no process group
    data = make_batch(301, B=8, R=6, seed=3)
    res = {}
    for tp, pp in ((2, 2), (1, 1)):
        layout = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        actor = ActorWorker(ModelConfig(path=path), ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2,
                                                                megatron=layout, optim=OptimConfig(lr=1e-3)))
        res[("actor", tp, pp)] = _worst(_run_modes(actor.engine, data, actor._process(TEMP, True),
                                                   actor._process(TEMP, True, True), ("log_probs", "entropy")))
        if tp == 2:
            # The lean log-prob against the materialised vocab-parallel logits, values and grads.
            g = torch.Generator().manual_seed(0)
            hidden = torch.randn(19, 8, generator=g)
            weight = torch.randn(2, 192, 8, generator=g)[state.tp_group().rank()]   # this rank's vocab rows
            targets = torch.randint(0, 301, (19,), generator=g)
            grads = []
            for fn in (lambda h, w: token_log_probs(h @ w.t() / TEMP, targets, 192 * state.tp_group().rank(), 301,
                                                   state.tp_group()),
                       lambda h, w: linear_log_probs(h, w, targets, 192 * state.tp_group().rank(), 301,
                                                     state.tp_group(), TEMP, chunk=5)):
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                lp, ent = fn(h, w)
                (lp.sum() + (ent * torch.linspace(0, 1, 19)).sum()).backward()
                grads.append((lp.detach(), ent.detach(), h.grad, w.grad))
            res["lean_tp2"] = max((a - b).abs().max().item() for a, b in zip(*grads))
        del actor
        state.destroy_model_parallel()
    layout = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    critic = CriticWorker(CriticConfig(model=CriticModelConfig(path=rm_path, init_from="path"), megatron=layout,
                                       ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2))
    res["critic"] = _worst(_run_modes(critic.engine, data, value_outputs, value_outputs, ("values",)))
    return res


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return (make_tiny_hf(str(root / "qwen2"), "qwen2", seed=1, vocab_size=301),
            make_tiny_hf(str(root / "rm"), "qwen2", seed=3, vocab_size=301, score_head=True))


@pytest.mark.timeout(600)
def test_packed_and_token_budget_micro_batches_equal_the_padded_path(models):
    results = run_ranks(4, check_packing, models)
    res = results[0]
    for key in [k for k in res if k != "lean_tp2"]:
        for mode, (d_rows, d_grads, (computed, real)) in res[key].items():
            assert d_rows <= 1e-5 and d_grads <= 1e-5, (key, mode, d_rows, d_grads)
        padded = res[key][("padded", None)][2]
        packed = res[key][("packed", 24)][2]
        assert packed[1] == padded[1] and packed[0] < padded[0]   # same real tokens, less computed
    assert res["lean_tp2"] <= 1e-5
    # every rank computes the same padding figures from the same plan
    assert all(r[("actor", 1, 1)][("packed", 24)][2] == res[("actor", 1, 1)][("packed", 24)][2] for r in results)
    assert res[("actor", 1, 1)][("packed", None)][2][0] == res[("actor", 1, 1)][("packed", None)][2][1]  # ratio 1
