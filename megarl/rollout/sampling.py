"""Training and validation SamplingParams from `actor_rollout_ref.rollout` (verl's keys).

    train = train_sampling(cfg.rollout, eos_token_ids=[tok.eos_token_id])
    val = val_sampling(cfg.rollout, eos_token_ids=[tok.eos_token_id])     # rollout.val_kwargs

Validation takes temperature / top_p / top_k / n / do_sample from `val_kwargs` (verl's default:
greedy, n=1) and everything else (length, stops, penalty) from the training settings. A seed
given in the config is offset per call by the caller (e.g. seed + step) so steps differ but a
resumed run repeats them exactly. `mix64` is the hash every engine's counter-based sampling and the
agent loop's per-turn seeds are built from.
"""
from __future__ import annotations

from collections.abc import Sequence

from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig

_MASK62 = (1 << 62) - 1
MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit hash with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_seed(base: int, step: int, stream: int = 0) -> int:
    """A sampling seed per (run seed, step, stream). Every step draws fresh randomness, and a
    resumed run repeats a step's samples exactly."""
    x = (base * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK62
    return x or 1


def _response_length(cfg: RolloutConfig) -> int:
    if cfg.response_length is None:
        raise ValueError("rollout.response_length is unset: set actor_rollout_ref.rollout.response_length "
                         "or data.max_response_length")
    return cfg.response_length


def train_sampling(cfg: RolloutConfig, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, n=cfg.n,
        max_tokens=_response_length(cfg), stop_token_ids=list(cfg.stop_token_ids), ignore_eos=cfg.ignore_eos,
        repetition_penalty=cfg.repetition_penalty, seed=cfg.seed if seed is None else seed,
        do_sample=cfg.do_sample, eos_token_ids=[int(t) for t in eos_token_ids if t is not None])


def val_sampling(cfg: RolloutConfig, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> SamplingParams:
    v = cfg.val_kwargs
    return train_sampling(cfg, eos_token_ids, seed).with_(
        temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, n=v.n, do_sample=v.do_sample)
