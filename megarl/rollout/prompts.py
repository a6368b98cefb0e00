"""Prompt checks every engine runs before generating (one place, so every engine refuses alike).

    guard = PromptGuard(max_length=cfg.prompt_length, truncation=cfg.prompt_truncation, vocab_size=V)
    prompts = guard.apply(prompts)        # raises before anything runs; guard.truncated counts
    prompts = guard.apply(prompts, max_length=L)   # this call's own limit (agent-loop continuations)

Empty prompts are refused. Prompts longer than `max_length` are refused (truncation="error") or
keep their last `max_length` tokens (truncation="left", the end of a chat is what the model
answers); both cases are counted so the trainer can log them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PromptGuard:
    max_length: int | None = None
    truncation: str = "error"              # "error" | "left"
    vocab_size: int | None = None
    truncated: int = 0                     # prompts cut from the left so far
    refused: int = 0                       # calls refused for an over-long or empty prompt

    def __post_init__(self):
        if self.truncation not in ("error", "left"):
            raise ValueError(f"prompt_truncation={self.truncation!r} must be 'error' or 'left'")

    def apply(self, prompts: Sequence[Sequence[int]], max_length: int | None = None) -> list[list[int]]:
        """`max_length`: this call's limit in place of the configured one (None: the configured one)."""
        limit = self.max_length if max_length is None else max_length
        if len(prompts) == 0:
            raise ValueError("generate() got no prompts")
        out, cut = [], 0
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                raise TypeError(f"prompt {i} is a string; rollout engines take token ids (tokenize first)")
            p = [int(t) for t in p]
            if not p:
                self.refused += 1
                raise ValueError(f"prompt {i} is empty; drop empty rows before rollout "
                                 "(an empty prompt has no position to generate from)")
            if self.vocab_size is not None and (min(p) < 0 or max(p) >= self.vocab_size):
                self.refused += 1
                bad = next(t for t in p if t < 0 or t >= self.vocab_size)
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {self.vocab_size}); "
                                 "was it tokenized with another tokenizer?")
            if limit is not None and len(p) > limit:
                if self.truncation == "left":
                    p, cut = p[-limit:], cut + 1
                else:
                    self.refused += 1
                    raise ValueError(
                        f"prompt {i} has {len(p)} tokens, more than rollout.prompt_length={limit}; "
                        f"set actor_rollout_ref.rollout.prompt_truncation=left to keep its last "
                        f"{limit} tokens, or raise prompt_length (data.max_prompt_length)")
            out.append(p)
        self.truncated += cut                # counted only once the whole batch is accepted
        return out

    def stats(self) -> dict[str, int]:
        return {"rollout/prompts_truncated": self.truncated, "rollout/prompts_refused": self.refused}
