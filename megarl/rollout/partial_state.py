"""The checks a half-generated batch's saved state passes before a resume trains on it.

A checkpoint's stream state (megarl/rollout/partial.py's ChunkedGeneration.state_dict) decides which
responses are complete and which tokens carry which log-prob and weight version. A damaged or
crafted one must not load quietly: a cut-off response marked finished would be trained on as if
the model had ended it, a token without its log-prob would shift every later one. Each field is
checked; a violation is one ConfigError line naming the field's place in the checkpoint.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from megarl.config.errors import ConfigError

FINISHED = ("stop", "length", "abort")     # a saved sequence is one of these, or None (still running)
KEY = "trainer.resume_mode"
FIX = ("; the checkpoint is damaged or not megarl's: resume from another one (trainer.resume_from_path) or "
       "start afresh (trainer.resume_mode=disable)")


def refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"the checkpoint's stream state: {where} {what}{FIX}", KEY)


def whole(value: Any, where: str, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int within [low, high] (bool is not one), else refused naming `where`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise refuse(where, f"is {value!r} ({type(value).__name__}), not a whole number")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
        raise refuse(where, f"is {value}, outside {span}")
    return value


def listed(value: Any, where: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise refuse(where, f"is a {type(value).__name__}, not a list")
    return list(value)


def check_generation(state: Any, prompts: list[list[int]], n: int, max_tokens: int, max_version: int | None,
                     where: str) -> None:
    """A ChunkedGeneration's saved state against the generation it loads into: `prompts` (each
    sampled `n` times) at most `max_tokens` long, tokens sampled by weight versions 0..max_version."""
    if not isinstance(state, dict):
        raise refuse(where, f"is a {type(state).__name__}, not a dict")
    whole(state.get("chunks_done"), f"{where}.chunks_done", 0)
    seqs = listed(state.get("seqs"), f"{where}.seqs")
    if len(seqs) != len(prompts) * n:
        raise refuse(f"{where}.seqs", f"holds {len(seqs)} sequences, this generation {len(prompts) * n} "
                                      f"({len(prompts)} prompts x {n})")
    for i, s in enumerate(seqs):
        check_sequence(s, prompts[i // n], max_tokens, max_version, f"{where}.seqs[{i}]")


def check_sequence(s: Any, prompt: list[int], max_tokens: int, max_version: int | None, where: str) -> None:
    if not isinstance(s, dict):
        raise refuse(where, f"is a {type(s).__name__}, not a dict")
    if [int(x) for x in listed(s.get("prompt"), f"{where}.prompt")] != list(prompt):
        raise refuse(f"{where}.prompt", "is not the prompt of this batch's row")
    tokens = listed(s.get("tokens"), f"{where}.tokens")
    for j, tok in enumerate(tokens):
        whole(tok, f"{where}.tokens[{j}]", 0)
    log_probs = listed(s.get("log_probs"), f"{where}.log_probs")
    if len(log_probs) != len(tokens):
        raise refuse(f"{where}.log_probs", f"holds {len(log_probs)} values for {len(tokens)} tokens")
    for j, lp in enumerate(log_probs):
        if isinstance(lp, bool) or not isinstance(lp, numbers.Real) or not math.isfinite(lp):
            raise refuse(f"{where}.log_probs[{j}]", f"is {lp!r}, not a finite number")
    versions = listed(s.get("versions"), f"{where}.versions")
    if len(versions) != len(tokens):
        raise refuse(f"{where}.versions", f"holds {len(versions)} values for {len(tokens)} tokens")
    for j, v in enumerate(versions):
        whole(v, f"{where}.versions[{j}]", 0, max_version)
        if j and v < versions[j - 1]:
            raise refuse(f"{where}.versions[{j}]", f"is {v}, older than the token before it ({versions[j - 1]})")
    finish = s.get("finish")
    if finish is not None and finish not in FINISHED:
        raise refuse(f"{where}.finish", f"is {finish!r}, not one of {', '.join(FINISHED)} or null (unfinished)")
    if len(tokens) > max_tokens:
        raise refuse(f"{where}.tokens", f"holds {len(tokens)} tokens, more than the {max_tokens} a response may have")
    if finish is None and len(tokens) == max_tokens:
        raise refuse(f"{where}.finish", f"is null (unfinished) at the full {max_tokens} tokens")
