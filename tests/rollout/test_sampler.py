"""The built-in engine's sampling functions against hand-computed values and frequencies."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.rollout.native import sampler


def test_uniforms_are_deterministic_distinct_and_uniform():
    key = sampler.sample_key(seed=1, prompt_index=2, sample_index=3)
    assert key == sampler.sample_key(1, 2, 3)
    assert len({sampler.sample_key(1, p, s) for p in range(20) for s in range(20)}) == 400
    u = [sampler.uniform(key, t) for t in range(20000)]
    assert all(0.0 <= x < 1.0 for x in u)
    assert sampler.uniform(key, 5) == u[5]
    hist = torch.histc(torch.tensor(u), bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.01                    # ~6 sigma for 2000 per bin
    assert abs(sum(u) / len(u) - 0.5) < 0.01


def test_inverse_cdf_draws_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.25, 0.05]])
    key = sampler.sample_key(0, 0, 0)
    draws = [int(sampler.inverse_cdf(probs, torch.tensor([sampler.uniform(key, t)], dtype=torch.float64)))
             for t in range(20000)]
    freq = torch.bincount(torch.tensor(draws), minlength=5).double() / len(draws)
    assert freq[1] == 0, "a zero-probability token was drawn"
    assert (freq - probs[0].double()).abs().max() < 0.015
    # unnormalised input and u at the edges
    assert sampler.inverse_cdf(probs * 3, torch.tensor([0.0])).item() == 0
    assert sampler.inverse_cdf(probs, torch.tensor([1.0 - 1e-16])).item() == 4


def test_truncate_top_k_then_top_p():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]])

    def kept(top_k, top_p):
        out = sampler.truncate(p, top_k=top_k, top_p=top_p)
        assert torch.equal(out[out > 0], p[out > 0]), "kept probabilities must be unchanged"
        return (out > 0).int().tolist()[0]
    assert kept(2, 1.0) == [1, 1, 0, 0]
    # nucleus 0.6: 0.4 (mass before it 0) and 0.3 (mass before 0.4 < 0.6) stay, 0.2 goes (0.7 >= 0.6)
    assert kept(-1, 0.6) == [1, 1, 0, 0]
    assert kept(-1, 0.1) == [1, 0, 0, 0]
    assert kept(-1, 0.95) == [1, 1, 1, 1]
    # top-p after top-k is over the renormalised top-k mass: 0.4/0.7 = 0.57 < 0.6 keeps two
    assert kept(2, 0.6) == [1, 1, 0, 0]
    assert kept(2, 0.5) == [1, 0, 0, 0]


def test_repetition_penalty_rule():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert sampler.apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_sample_reports_the_convention_log_prob():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    u = torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
    tok, lp = sampler.sample(logits, temperature=0.7, top_k=5, top_p=0.8, greedy=False, u=u)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    assert torch.allclose(lp, ref)
    assert all(t in logits[i].topk(5).indices for i, t in enumerate(tok.tolist()))
    tok, lp = sampler.sample(logits, temperature=0.7, top_k=-1, top_p=1.0, greedy=True, u=u)
    assert tok.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(lp, torch.log_softmax(logits, -1).max(-1).values)     # greedy: T=1
    seen = torch.zeros(4, 50, dtype=torch.bool)
    seen[torch.arange(4), logits.argmax(-1)] = True
    tok2, lp2 = sampler.sample(logits, temperature=1.0, top_k=-1, top_p=1.0, greedy=True, u=u,
                               seen=seen, repetition_penalty=100.0)
    assert (tok2 != tok).all(), "a huge penalty must move greedy off the seen token"
    assert torch.allclose(lp2, torch.log_softmax(logits, -1).gather(-1, tok2[:, None])[:, 0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    probs = torch.softmax(logits / temperature, -1)
    keys = [sampler.sample_key(3, 0, s) for s in range(8000)]
    u = torch.tensor([sampler.uniform(k, 0) for k in keys], dtype=torch.float64)
    tok, _ = sampler.sample(logits.expand(len(keys), -1), temperature=temperature, top_k=-1, top_p=1.0,
                            greedy=False, u=u)
    freq = torch.bincount(tok, minlength=5).double() / len(keys)
    sigma = torch.sqrt(probs.double() * (1 - probs.double()) / len(keys))
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-3).all(), (freq, probs)
    assert math.isclose(freq.sum().item(), 1.0)


def test_device_hash_equals_the_python_reference_bit_for_bit():
    """The tensor splitmix64 (int64 wrapping arithmetic, masked shifts) that the engine runs on
    the device gives exactly the Python reference's keys and uniforms, large seeds included."""
    prompts = torch.arange(40).repeat_interleave(5)
    samples = torch.arange(5).repeat(40)
    steps = torch.arange(200) * 7919 + (1 << 40)
    for seed in (0, 1, (1 << 63) + 5, (1 << 64) - 1, 123456789):
        keys = sampler.sample_keys(seed, prompts, samples)
        ref = [sampler.sample_key(seed, p, s) for p, s in zip(prompts.tolist(), samples.tolist())]
        assert [k & ((1 << 64) - 1) for k in keys.tolist()] == ref
        assert sampler.uniforms(keys, steps).tolist() == [sampler.uniform(k, t) for k, t in zip(ref, steps.tolist())]


def test_inverse_cdf_falls_back_to_the_mode_without_reading_back():
    """A target that rounds up to the total mass (u * total == total) lands on the zero-probability
    tail; it is replaced by the mode in tensor ops (no host branch, so the step stays capturable)."""
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.2, 0.0, 0.0, 0.0]])
    tok = sampler.inverse_cdf(probs, torch.tensor([1.0, 0.999999], dtype=torch.float64))
    assert tok.tolist() == [1, 0]
