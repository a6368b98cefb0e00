"""The engine cost model (`actor_rollout_ref.rollout.cost_model.*`): any engine's calls take at
least the wall time a GPU's would, by sleeping, so a CPU run is in the regime a GPU run is in
(generation the long phase) while its tokens, log-probs and weight versions stay the engine's own.

    megarl-train ... actor_rollout_ref.rollout.cost_model.enable=true actor_rollout_ref.rollout.cost_model.scale=100

A decode step costs at least `decode_s + decode_row_s * rows` and a prefill `prefill_token_s` per
prompt token, all times `scale`. The defaults are the built-in engine's on one H100 (docs/measurements.md,
the section on async training on the long-tailed task): 0.46 ms a decode step, the same for few rows as
for many (CUDA graph replays), so no per-row term; 0.058 s of prefill for 512 prompts of that task,
7.15 tokens each on average (16 us a token). `scale` stretches the GPU's time by the factor a CPU
trainer is slower than a GPU's, so the two phases keep a GPU node's proportion; it is a choice, named
beside every figure taken under the model (`describe()`).

The sleep happens where the engine's time is observable: at every chunk boundary of a pausable call
(the built-in engine's `generate_pausable`, where updates land) and at the end of every call. Decode
steps are the engine's own count where it keeps one (`stats["decode_steps"]`), else the longest
response of the call; rows per step come from who is still running.

What the model charges is booked per kind in the engine's `stats` (`paced_s/<kind>`, seconds summed
over calls): `decode` steps, `prefill_prompts` (new prompts), `prefill_continued` (prompts and their
responses so far, prefilled again when a stopped call is continued), and `regenerate` and `validate`
(whole calls made under `charged_as(engine, kind)`), so a run can say which part of generation its
time goes to. These are the model's charges; a call's wall time is the larger of them and its own. What the
caller does inside a boundary (its `pause` and `join`: a hand-off, a weight sync landing inside
the call) is off the model's clock, as a GPU engine's loop waits for it too; a batch that joins a
running call owes its prompts' prefill as new prompts.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from megarl.rollout.config import CostModelConfig


def describe(cfg: CostModelConfig) -> str:
    """One line naming the model, printed beside every figure taken under it."""
    return (f"under the cost model: decode step >= ({cfg.decode_s * 1e3:.3g} ms + "
            f"{cfg.decode_row_s * 1e6:.3g} us x rows) x {cfg.scale:g}, "
            f"prefill {cfg.prefill_token_s * 1e6:.3g} us/token x {cfg.scale:g} "
            "(built-in engine on one H100, docs/measurements.md 2026-11-27)")


KINDS = ("decode", "prefill_prompts", "prefill_continued", "regenerate", "validate")


@contextlib.contextmanager
def charged_as(engine: Any, kind: str) -> Iterator[None]:
    """Every call made inside is booked as `kind` whole (its prefill and decode steps together)."""
    assert kind in KINDS, f"cost model kinds: {KINDS}"
    before = getattr(engine, "pace_as", None)
    engine.pace_as = kind
    try:
        yield
    finally:
        if before is None:
            del engine.pace_as
        else:
            engine.pace_as = before


class PacedSeconds:
    """The seconds the model charged an engine per kind since the last `since()`, for a step's
    metrics (empty where the engine is not paced)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.last = self._now()

    def _now(self) -> dict[str, float]:
        stats = getattr(self.engine, "stats", None)
        return {k: v for k, v in stats.items() if k.startswith("paced_s/")} if isinstance(stats, dict) else {}

    def since(self) -> dict[str, float]:
        now = self._now()
        out = {"paced_" + k.split("/")[1]: v - self.last.get(k, 0.0) for k, v in now.items()}
        self.last = now
        return out


class Pacer:
    """The modelled seconds owed by one call, and the sleep that makes its wall time reach them."""

    def __init__(self, cfg: CostModelConfig, engine: Any, prompt_tokens: int, continued_tokens: int = 0):
        self.cfg, self.engine = cfg, engine
        self.start = time.perf_counter()
        self.steps0 = self._steps()
        self.counted = 0                          # decode steps already charged
        self.whole = getattr(engine, "pace_as", None)
        self.owed = 0.0
        self.by_kind: dict[str, float] = {}
        self._owe("prefill_prompts", cfg.scale * cfg.prefill_token_s * prompt_tokens)
        self._owe("prefill_continued", cfg.scale * cfg.prefill_token_s * continued_tokens)

    def _owe(self, kind: str, seconds: float) -> None:
        kind = self.whole or kind
        self.owed += seconds
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + seconds

    def _steps(self) -> int | None:
        stats = getattr(self.engine, "stats", None)
        return stats.get("decode_steps") if isinstance(stats, dict) else None

    def prefill(self, tokens: int) -> None:
        """New prompts that joined the call."""
        self._owe("prefill_prompts", self.cfg.scale * self.cfg.prefill_token_s * tokens)

    def aside(self, fn, *args):
        """fn(*args) off the modelled clock: the caller's work inside a boundary (a hand-off, a
        weight sync) keeps a GPU's engine from stepping as much as it keeps this one."""
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.start += time.perf_counter() - began

    def charge(self, steps: int, rows: int) -> None:
        """`steps` decode steps of `rows` rows each."""
        c = self.cfg
        self._owe("decode", c.scale * steps * (c.decode_s + c.decode_row_s * rows))
        self.counted += steps

    def steps_since_start(self, fallback: int) -> int:
        now = self._steps()
        return fallback if now is None or self.steps0 is None else now - self.steps0

    def wait(self) -> None:
        left = self.start + self.owed - time.perf_counter()
        if left > 0:
            time.sleep(left)                      # the CPU is free for the trainer meanwhile
        stats = getattr(self.engine, "stats", None)
        if isinstance(stats, dict):               # what the model asked of this call, and what it slept
            stats["paced_owed_s"] = self.owed
            stats["paced_s"] = stats.get("paced_s", 0.0) + max(0.0, left)
            for kind, seconds in self.by_kind.items():  # what this call charged since its last wait
                stats[f"paced_s/{kind}"] = stats.get(f"paced_s/{kind}", 0.0) + seconds
        self.by_kind = {}


def _prefill_split(prompts: list[list[int]], prefixes: list | None) -> tuple[int, int]:
    """(new, continued) tokens: a prompt is prefilled once for its samples; a prompt with a response
    so far is one a stopped call left unfinished, so it and those responses are prefilled again."""
    if prefixes is None:
        return sum(map(len, prompts)), 0
    again = [any(p) for p in prefixes]
    new = sum(len(q) for q, a in zip(prompts, again) if not a)
    return new, sum(map(len, prompts)) - new + sum(len(r) for p in prefixes for r in p)


def _charge_completions(pacer: Pacer, groups: list) -> None:
    """The call's decode steps not charged yet (the engine's count, else the longest response less
    the token its prefill samples), rows per step from who ran that long."""
    lengths = [len(c.token_ids) for g in groups for c in g]
    steps = pacer.steps_since_start(max(lengths, default=1) - 1)
    for t in range(pacer.counted, steps):
        pacer.charge(1, sum(1 for x in lengths if x > t + 1) or 1)


def pace(engine: Any, cfg: CostModelConfig) -> Any:
    """Wrap `engine`'s generate (and generate_pausable, where it has one) in place: same results,
    at least the modelled wall time. Returns the engine."""
    if not cfg.enable:
        return engine
    # said once per engine, so a run's log tells figures taken under the model from real ones
    print(f"megarl: rollout engine {type(engine).__name__} paced {describe(cfg)}", flush=True)
    generate = engine.generate

    def paced_generate(prompts, sampling, prompt_limit=None):
        pacer = Pacer(cfg, engine, sum(map(len, prompts)))
        out = generate(prompts, sampling, prompt_limit)
        _charge_completions(pacer, out)
        pacer.wait()
        return out

    engine.generate = paced_generate
    if hasattr(engine, "generate_pausable"):
        pausable = engine.generate_pausable

        @functools.wraps(pausable)        # its signature: the keywords it takes (partial.py reads them)
        def paced_pausable(prompts, sampling, pause, every, budgets=None, samples=None, prefixes=None, **kwargs):
            pacer = Pacer(cfg, engine, *_prefill_split(prompts, prefixes))
            boundaries = 0

            def paced_pause(unfinished: dict[int, int]) -> bool:
                # The steps since the last boundary ran with at most the rows still running now
                # plus those that finished in them; the rows now are the charge (b = 0 on the H100).
                nonlocal boundaries
                boundaries += 1
                done = pacer.steps_since_start(boundaries * every)
                pacer.charge(done - pacer.counted, sum(unfinished.values()))
                pacer.wait()
                return pacer.aside(pause, unfinished)

            if kwargs.get("join") is not None:
                join = kwargs["join"]

                def paced_join():
                    got = pacer.aside(join)
                    if got:                       # a new batch's prompts, prefilled inside this call
                        pacer.prefill(sum(map(len, got[0])))
                    return got
                kwargs["join"] = paced_join

            out = pausable(prompts, sampling, paced_pause, every, budgets, samples, prefixes, **kwargs)
            _charge_completions(pacer, out)
            pacer.wait()
            return out

        engine.generate_pausable = paced_pausable
    return engine
