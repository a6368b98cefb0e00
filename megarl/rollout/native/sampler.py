"""Token sampling for the built-in engine: small pure functions over [B, V] logits.

Randomness is counter-based: sample j of prompt i at step t draws the uniform
u = hash(seed, i, j, t). So the same seed, prompts and weights give the same tokens whatever the
batch composition, slot order, device or TP rank (every rank computes the same u and sees the
same gathered logits), which is what exact resume of training needs. Sampling is by inverse CDF:
the token whose cumulative probability first exceeds u.

The hash is splitmix64, computed on the device over int64 tensors (`sample_keys`, `uniforms`):
multiplication and addition wrap modulo 2^64 there as in uint64, and right shifts are made
logical by masking, so the tensor version equals the Python one (`sample_key`, `uniform`, kept
as the reference) bit for bit. Nothing here reads a value back to the host, so a decode step,
sampling included, can run under a CUDA graph.

Order, as transformers and vLLM: repetition penalty -> temperature -> top-k -> top-p (over the
top-k-renormalised distribution). The reported log-prob follows megarl/rollout/base.py: the
sampled token's log_softmax(logits / temperature), before penalty and truncation.
"""
from __future__ import annotations

import torch

from megarl.rollout.sampling import MASK64 as _M64, mix64


def sample_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The per-sample stream key; the engine keeps it per slot and adds the step."""
    return mix64(mix64(mix64(seed & _M64) ^ prompt_index) ^ sample_index)


def uniform(key: int, step: int) -> float:
    """A uniform in [0, 1) with 53 random bits, for (sample key, step)."""
    return (mix64(key ^ mix64(step)) >> 11) * (1.0 / (1 << 53))


def _signed(v: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


_C0, _C1, _C2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64_t(x: torch.Tensor) -> torch.Tensor:
    """mix64 over an int64 tensor (wrapping arithmetic): equal bits to mix64 elementwise."""
    x = x + _C0
    x = (x ^ _srl(x, 30)) * _C1
    x = (x ^ _srl(x, 27)) * _C2
    return x ^ _srl(x, 31)


def sample_keys(seed: int, prompt_index: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """sample_key over int64 tensors of prompt / sample indices (same bits as sample_key)."""
    return mix64_t(mix64_t(_signed(mix64(seed & _M64)) ^ prompt_index) ^ sample_index)


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """uniform over int64 tensors of keys and steps -> float64 in [0, 1) (same values as uniform)."""
    return _srl(mix64_t(keys ^ mix64_t(steps)), 11).double() * (1.0 / (1 << 53))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' rule on tokens already in the sequence: positive logits / p, negative * p."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside top-k, then outside the top-p nucleus (not renormalised:
    inverse-CDF sampling scales by the remaining mass)."""
    B, V = probs.shape
    if top_k != -1 and top_k < V:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]                            # [B, 1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)                   # [B, V]
        mass = sorted_p.sum(-1, keepdim=True)
        before = sorted_p.cumsum(-1) - sorted_p                                 # mass strictly above each
        drop_sorted = before >= top_p * mass                                    # the first token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unnormalised, >= 0), u [B] in [0, 1) -> token ids [B]."""
    cdf = probs.double().cumsum(-1)                                             # [B, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)                            # [B, 1]
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    # Rounding can land on a zero-probability id at the very end; fall back to the mode there
    # (unconditionally: testing for it first would read a value back to the host).
    bad = probs.gather(-1, tok[:, None]).squeeze(-1) <= 0
    return torch.where(bad, probs.argmax(-1), tok)


def sample(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, greedy: bool,
           u: torch.Tensor, seen: torch.Tensor | None = None, repetition_penalty: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B], reported log-probs [B])."""
    lp_temp = 1.0 if greedy else temperature
    logp_all = torch.log_softmax(logits / lp_temp if lp_temp != 1.0 else logits, dim=-1)   # [B, V]
    z = logits
    if repetition_penalty != 1.0 and seen is not None:
        z = apply_repetition_penalty(z, seen, repetition_penalty)
    if greedy:
        tok = z.argmax(-1)
    else:
        if z is logits:
            probs = logp_all.exp()                                              # softmax(logits / T)
        else:
            probs = torch.softmax(z / temperature, dim=-1)
        tok = inverse_cdf(truncate(probs, top_k, top_p), u)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)
