"""The rollout contract, as checks that run against any engine (tests/rollout/test_conformance.py
runs them on native TP=1, native TP=2 over two gloo ranks, hf, a user's class, and trtllm where
it imports).

Each check takes `make(**config) -> engine` (a fresh engine on weights A, built through
build_rollout) and the fixture dirs; the numerical oracle is transformers' forward on
prompt + response, log_softmax(logits / T), in fp32. Checks return the figures they measured.
"""
from __future__ import annotations

import math

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.rollout.base import SamplingParams
from tests.rollout.fixtures import in_buckets, state_of

PROMPTS = [[3, 17, 42, 8, 9], [55, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
TOL = 1e-5


class Oracle:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def logprobs(self, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
        logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_tokens: int, penalty: float = 1.0) -> list[int]:
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, repetition_penalty=penalty)
        return out[0, len(prompt):].tolist()

    def max_error(self, groups, prompts, temperature: float) -> float:
        worst = 0.0
        for prompt, group in zip(prompts, groups):
            for c in group:
                got = torch.tensor(c.log_probs)
                assert torch.isfinite(got).all(), f"non-finite log-probs {c.log_probs}"
                worst = max(worst, (got - self.logprobs(prompt, c.token_ids, temperature)).abs().max().item())
        return worst


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def check_shapes_and_n(make, dirs) -> dict:
    engine = make()
    groups = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=6, seed=0))
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    for g in groups:
        for c in g:
            assert len(c.token_ids) == 6 and len(c.log_probs) == 6 and c.finish_reason == "length"
            assert all(0 <= t < 96 for t in c.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in c.log_probs)
    return {}


def check_greedy_matches_hf(make, dirs) -> dict:
    engine, oracle = make(), Oracle(dirs["model_a"])
    groups = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, do_sample=False, temperature=0.7))
    for prompt, g in zip(PROMPTS, groups):
        ref = oracle.greedy(prompt, 10)
        for c in g:
            assert c.token_ids == ref, f"greedy {c.token_ids} != transformers {ref}"
    same = engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=10, temperature=0.0))
    assert _tokens(same) == [[g[0].token_ids] for g in groups], "temperature=0 must be greedy too"
    # Greedy log-probs follow the convention's T=1 even though temperature=0.7 was passed.
    return {"greedy_logprob_max_abs_err": oracle.max_error(groups, PROMPTS, 1.0)}


def _generate_or_refused(engine, prompts, sp):
    """Engines whose library reports no exact log-prob for temperature mixed with top-k/top-p/penalty
    (trtllm: raw is before temperature, processed after truncation) declare it and must refuse
    that mix with a ConfigError; every other engine must serve it."""
    try:
        return engine.generate(prompts, sp)
    except ConfigError:
        mixed = sp.temperature != 1.0 and (sp.top_k != -1 or sp.top_p != 1.0 or sp.repetition_penalty != 1.0)
        if mixed and getattr(engine, "refuses_truncated_temperature", False):
            return None
        raise


def check_sampled_logprobs(make, dirs) -> dict:
    engine, oracle = make(), Oracle(dirs["model_a"])
    err = 0.0
    for sp in (SamplingParams(n=2, max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=3),
               SamplingParams(n=2, max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=6),
               SamplingParams(n=2, max_tokens=8, temperature=1.3, seed=4)):
        groups = _generate_or_refused(engine, PROMPTS, sp)
        if groups is None:
            continue
        err = max(err, oracle.max_error(groups, PROMPTS, sp.temperature))
    assert err <= TOL, f"log-probs differ from transformers by {err:.2e} > {TOL}"
    # top-k is honoured: every sampled token is among the oracle's 3 most likely.
    groups = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, top_k=3, seed=5))
    for prompt, g in zip(PROMPTS, groups):
        for c in g:
            logits = oracle.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
            top = logits.topk(3, -1).indices
            assert all(t in top[i] for i, t in enumerate(c.token_ids)), "a token outside top_k=3 was sampled"
    return {"sampled_logprob_max_abs_err": err}


def check_stops(make, dirs) -> dict:
    engine = make()
    greedy = dict(n=1, max_tokens=8, do_sample=False)
    ref = engine.generate(PROMPTS[:1], SamplingParams(**greedy))[0][0].token_ids
    stop = ref[2]
    cut = ref[:ref.index(stop) + 1]
    for sp in (SamplingParams(**greedy, stop_token_ids=[stop]), SamplingParams(**greedy, eos_token_ids=[stop])):
        c = engine.generate(PROMPTS[:1], sp)[0][0]
        assert c.token_ids == cut and c.finish_reason == "stop", (c.token_ids, cut, c.finish_reason)
        assert len(c.log_probs) == len(cut)
    c = engine.generate(PROMPTS[:1], SamplingParams(**greedy, eos_token_ids=[stop], ignore_eos=True))[0][0]
    assert c.token_ids == ref and c.finish_reason == "length", "ignore_eos must run past EOS"
    c = engine.generate(PROMPTS[:1], SamplingParams(n=1, max_tokens=2, do_sample=False))[0][0]
    assert c.token_ids == ref[:2] and c.finish_reason == "length"
    return {}


def check_seed_determinism(make, dirs) -> dict:
    engine = make()
    sp = SamplingParams(n=2, max_tokens=8, seed=7)
    first, again = _tokens(engine.generate(PROMPTS, sp)), _tokens(engine.generate(PROMPTS, sp))
    assert first == again, "the same seed must give the same tokens"
    assert _tokens(engine.generate(PROMPTS, sp.with_(seed=8))) != first, "another seed gave identical tokens"
    assert first[0][0] != first[0][1], "the n samples of a prompt must differ"
    # Prompts of one call draw from streams of their own: equal prompts (a dataset's duplicates,
    # a group's retries) give different samples, as separate calls would.
    twice = _tokens(engine.generate([PROMPTS[0], PROMPTS[0]], sp))
    assert twice[0] != twice[1], "equal prompts of one call drew the same samples (one random stream for all)"
    return {}


def _sync(engine, named, buckets: int = 3) -> None:
    for bucket in in_buckets(named, buckets):
        engine.update_weights(bucket)
    engine.finalize_weights()


def check_weight_update(make, dirs) -> dict:
    engine, new = make(), Oracle(dirs["model_b"])
    sp = SamplingParams(n=1, max_tokens=10, do_sample=False)
    before = _tokens(engine.generate(PROMPTS, sp))
    _sync(engine, state_of(dirs["model_b"]))
    groups = engine.generate(PROMPTS, sp)
    assert _tokens(groups) != before, "new weights did not change the output"
    for prompt, g in zip(PROMPTS, groups):
        assert g[0].token_ids == new.greedy(prompt, 10)
    sampled = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=1))
    err = max(new.max_error(groups, PROMPTS, 1.0), new.max_error(sampled, PROMPTS, 0.9))
    assert err <= TOL, f"after the sync, log-probs differ from the new weights' by {err:.2e}"
    return {"after_sync_logprob_max_abs_err": err}


def check_incomplete_sync_refused(make, dirs) -> dict:
    engine, new = make(), Oracle(dirs["model_b"])
    named = state_of(dirs["model_b"])
    for bucket in in_buckets(named[:-1], 2):
        engine.update_weights(bucket)
    with pytest.raises(ValueError, match=named[-1][0].replace(".", r"\.")):
        engine.finalize_weights()
    old = Oracle(dirs["model_a"])
    greedy6 = SamplingParams(max_tokens=6, do_sample=False)
    try:                                      # in-place engines refuse; staging engines keep the old weights
        out = engine.generate(PROMPTS[:1], greedy6)[0][0].token_ids
        assert out == old.greedy(PROMPTS[0], 6), "an incomplete sync must not leave a mix of weights"
    except RuntimeError:
        pass
    _sync(engine, named)
    assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, do_sample=False))[0][0].token_ids == \
        new.greedy(PROMPTS[0], 6)
    # An aborted sync: the engine either kept the old weights or refuses until a full sync.
    engine.update_weights(state_of(dirs["model_a"])[:3])
    engine.abort_weight_update()
    try:
        out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, do_sample=False))[0][0].token_ids
        assert out == new.greedy(PROMPTS[0], 6), "after abort the old weights must stay active"
    except RuntimeError:
        _sync(engine, state_of(dirs["model_a"]))
        assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, do_sample=False))[0][0].token_ids == \
            old.greedy(PROMPTS[0], 6)
    return {}


def check_sleep_wake(make, dirs) -> dict:
    engine, oracle = make(), Oracle(dirs["model_a"])
    sp = SamplingParams(n=1, max_tokens=8, do_sample=False)
    engine.generate(PROMPTS, sp)
    if not getattr(engine, "sleeps", True):   # declared unable (vLLM on CPU): it must say so, not pretend
        with pytest.raises(RuntimeError, match="no sleep mode"):
            engine.sleep()
        return {}
    engine.sleep()
    engine.wake()
    try:
        groups = engine.generate(PROMPTS, sp)
    except RuntimeError:                      # weights dropped in sleep: they return with a sync
        _sync(engine, state_of(dirs["model_a"]))
        groups = engine.generate(PROMPTS, sp)
    for prompt, g in zip(PROMPTS, groups):
        assert g[0].token_ids == oracle.greedy(prompt, 8)
    assert oracle.max_error(groups, PROMPTS, 1.0) <= TOL
    return {}


def check_bad_input(make, dirs) -> dict:
    engine = make(prompt_length=6)
    ok = SamplingParams(max_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], ok)
    with pytest.raises(ValueError, match="prompt_truncation=left"):
        engine.generate(PROMPTS, ok)           # prompt 2 has 9 tokens > 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2, 500]], ok)
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0), dict(n=0), dict(top_k=0)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
        sp = SamplingParams(max_tokens=4)
        for k, v in bad.items():
            setattr(sp, k, v)                  # bypassing __post_init__: the engine must still refuse
        with pytest.raises(ConfigError):
            engine.generate(PROMPTS[:2], sp)
    left = make(prompt_length=6, prompt_truncation="left")
    got = left.generate(PROMPTS, ok)
    assert got[2][0].token_ids == left.generate([PROMPTS[2][-6:]], ok)[0][0].token_ids
    assert left.guard.truncated == 1, "each left-truncated prompt is counted once"
    return {}


CHECKS = [check_shapes_and_n, check_greedy_matches_hf, check_sampled_logprobs, check_stops,
          check_seed_determinism, check_weight_update, check_incomplete_sync_refused, check_sleep_wake,
          check_bad_input]


def run_all(make, dirs) -> dict:
    figures = {}
    for check in CHECKS:
        figures.update(check(make, dirs))
    return figures
