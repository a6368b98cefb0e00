"""The built-in engine on CUDA: decode steps captured in CUDA graphs replay exactly what the eager
step computes, greedy output and log-probs match transformers, and graphs follow weight syncs and
sleep. Skipped where CUDA is absent (the CPU tests in tests/rollout/ run the same step eagerly,
the padded static-shape path included).

    python -m pytest -q tests/gpu/test_native_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.native import NativeEngine
from tests.rollout.conformance import PROMPTS, Oracle
from tests.rollout.fixtures import save_model, state_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SP = SamplingParams(n=3, max_tokens=12, seed=2, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2,
                    stop_token_ids=[5, 6, 7])


def _engine(path, **kw):
    return NativeEngine.from_pretrained(path, device="cuda", dtype="float32", **kw)


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def test_graph_replay_equals_the_eager_step(tmp_path):
    save_model(str(tmp_path), seed=11)
    graphs, eager = _engine(str(tmp_path)), _engine(str(tmp_path), enforce_eager=True)
    prompts = PROMPTS + [[9, 9], [40, 41, 42, 43, 44, 45]]
    want, got = eager.generate(prompts, SP), graphs.generate(prompts, SP)
    assert _tokens(got) == _tokens(want)
    flat = lambda groups: [x for g in groups for c in g for x in c.log_probs]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    stats = dict(graphs.decode.stats)
    assert stats["captured"] > 0 and stats["replayed"] > 0 and stats["eager"] == 0, stats
    assert eager.decode.stats["captured"] == 0
    again = graphs.generate(prompts, SP)                 # same shapes: replays only
    assert _tokens(again) == _tokens(want)
    assert graphs.decode.stats["captured"] == stats["captured"]
    # prompts with fewer samples than n (a stream's new batch beside continued responses) run in
    # the same graphs' grid; sample j of prompt i is the one a full call draws
    counts = [1 + i % SP.n for i in range(len(prompts))]
    mixed = graphs.generate_pausable(prompts, SP, lambda unfinished: False, 4, samples=counts)
    assert _tokens(mixed) == [g[:k] for g, k in zip(_tokens(want), counts)]


def test_greedy_and_logprobs_match_transformers_on_cuda(tmp_path):
    model = save_model(str(tmp_path), seed=12)
    engine, oracle = _engine(str(tmp_path)), Oracle(model)
    greedy = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, do_sample=False))
    for prompt, g in zip(PROMPTS, greedy):
        assert all(c.token_ids == oracle.greedy(prompt, 12) for c in g)
    sampled = engine.generate(PROMPTS, SP)
    assert max(oracle.max_error(greedy, PROMPTS, 1.0), oracle.max_error(sampled, PROMPTS, 0.8)) <= 1e-4


def test_graphs_follow_weight_syncs_and_sleep(tmp_path):
    save_model(str(tmp_path / "a"), seed=13)
    new = Oracle(save_model(str(tmp_path / "b"), seed=14))
    engine = _engine(str(tmp_path / "a"))
    greedy = SamplingParams(max_tokens=10, do_sample=False)
    engine.generate(PROMPTS, greedy)
    engine.update_weights(state_of(new.model))          # in place: the captured graphs read them
    engine.finalize_weights()
    assert [g[0].token_ids for g in engine.generate(PROMPTS, greedy)] == [new.greedy(p, 10) for p in PROMPTS]
    engine.sleep(level=2)                                # weights and cache reallocated on return
    engine.wake()
    engine.update_weights(state_of(new.model))
    engine.finalize_weights()
    before = engine.decode.stats["captured"]
    assert [g[0].token_ids for g in engine.generate(PROMPTS, greedy)] == [new.greedy(p, 10) for p in PROMPTS]
    assert engine.decode.stats["captured"] > before, "graphs must be captured again after reallocation"
