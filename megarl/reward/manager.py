"""The reward manager: a rolled-out batch in, token-level scores and per-sample info out.

    manager = build_reward_manager(cfg, tokenizer)
    future = manager.compute_async(batch)       # returns at once with the Ray pool
    ...                                         # reference / critic passes run meanwhile
    result = manager.result(future)             # RewardResult
    result.apply(batch)                         # token_level_scores [B, R] + info fields in the batch

How a batch is scored is its scorer's (megarl/reward/scorers.py: built-in rules or a custom function,
per sample in process or in a Ray pool, a batched function, or a user's class). The manager is what
they share: failures counted against reward_model.max_failure_fraction, non-finite scores replaced,
the batch deadline, and shaping (format bonus, DAPO's overlong penalty; megarl/algos/shaping.py).
A batch that already holds `rm_scores` (a reward model's output, [B] or [B, R]) uses those.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from typing import Any

import torch

from megarl.algos.dapo import overlong_penalty
from megarl.algos.shaping import format_bonus
from megarl.protocol import DataProto
from megarl.reward.settings import RewardSettings
from megarl.reward.failures import (RewardDeadline, RewardFailure, deadline_error, in_daemon_thread,  # noqa: F401
                                    slowest_samples)
from megarl.reward.placement import place_scores, response_lengths
from megarl.reward.result import EXTRA_COLUMN, RewardResult, as_token_level  # noqa: F401
from megarl.reward.rules import format_reward
from megarl.reward.scorers import STUCK_GRACE_S, Scorer, build_scorer, decode_texts, ground_truth_of  # noqa: F401
from megarl.reward.scoring import Outcome, RewardExit


@dataclass
class RewardFuture:
    future: cf.Future
    batch: Any
    started: float


class RewardManager:
    def __init__(self, tokenizer: Any, scorer: Scorer, settings: RewardSettings = RewardSettings()):
        self.tokenizer, self.scorer, self.settings = tokenizer, scorer, settings
        self.totals = {"failures": 0, "timeouts": 0}

    # -- the API the loop calls -------------------------------------------------------------------
    def __call__(self, batch: DataProto) -> RewardResult:
        return self.result(self.compute_async(batch))

    def compute_async(self, batch: DataProto) -> RewardFuture:
        """Start scoring. With a Ray pool, a batched function or a custom class this returns at once
        and the work runs in a background thread; in-process per-sample scoring runs now (its timeout
        needs the main thread)."""
        started = time.perf_counter()
        if "rm_scores" in batch.batch:
            fut: cf.Future = cf.Future()
            try:
                fut.set_result(RewardResult(as_token_level(batch, batch.batch["rm_scores"], "rm_scores")))
            except (TypeError, ValueError) as err:    # raised by result(), as every scorer's errors are
                fut.set_exception(err)
        else:
            fut = self.scorer.start(batch, self.settings.deadline_s)
        return RewardFuture(fut, batch, started)

    def result(self, handle: RewardFuture) -> RewardResult:
        deadline_s, label = self.settings.deadline_s, self.scorer.label
        left = None if deadline_s is None else deadline_s - (time.perf_counter() - handle.started)
        try:
            # A little slack: the pool raises its own, more detailed, deadline error first.
            value = handle.future.result(timeout=None if left is None else max(left, 0) + 1.0)
        except cf.TimeoutError:
            raise deadline_error(label, deadline_s, len(handle.batch), None,
                                 "the call for the whole batch, still running") from None
        except RewardExit as err:
            raise RewardFailure(f"{label} {err} while scoring a batch of {len(handle.batch)} samples; a reward "
                                "must return a score (or raise), not end the process") from None
        batch = handle.batch
        res = value if isinstance(value, RewardResult) else self._from_outcomes(batch, value)
        self._sanitise(res)
        self._shape(batch, res)
        res.metrics["reward/latency_s"] = time.perf_counter() - handle.started  # overlaps the log-prob passes
        return res

    def close(self) -> None:
        self.scorer.close()

    # -- turning outputs into scores --------------------------------------------------------------
    def _sanitise(self, res: RewardResult) -> None:
        """NaN/inf in a tensor a custom manager or reward model returned: counted, told, and given
        reward_model.failure_score (a NaN would reach every advantage of its group)."""
        failure_score = self.settings.failure_score
        bad = ~torch.isfinite(res.token_level_scores)
        rows = int(bad.any(-1).sum())
        if rows:
            res.token_level_scores[bad] = failure_score
            res.metrics["reward/non_finite"] = res.metrics.get("reward/non_finite", 0.0) + rows
            res.notice = (res.notice + "; " if res.notice else "") + (
                f"{rows} of {bad.shape[0]} samples had a non-finite reward, given reward_model.failure_score="
                f"{failure_score:g}")

    def _from_outcomes(self, batch: DataProto, outcomes: list[Outcome]) -> RewardResult:
        n, limit, failure_score = len(outcomes), self.settings.max_failure_fraction, self.settings.failure_score
        failed = [i for i, o in enumerate(outcomes) if o.score is None]
        timeouts = sum(o.timed_out for o in outcomes)
        self.totals["failures"] += len(failed) - timeouts
        self.totals["timeouts"] += timeouts
        if n and len(failed) / n > limit:
            first = outcomes[failed[0]]
            raise RewardFailure(f"the reward function failed on {len(failed)} of {n} samples ({timeouts} timed out), "
                                f"more than reward_model.max_failure_fraction={limit}; first: "
                                f"sample {failed[0]}: {first.error}")
        scores = [failure_score if o.score is None else o.score for o in outcomes]
        keys = sorted({k for o in outcomes for k in o.info} - {"score"})
        info = {k: [o.info.get(k) for o in outcomes] for k in keys}
        info["reward_failed"] = [o.score is None for o in outcomes]
        # verl 0.9.1's reward loop: a dict's keys as returned, a number as acc (a failed sample: failure_score)
        verl_rows = [o.info if "score" in o.info else {"acc": s} for o, s in zip(outcomes, scores)]
        verl = {k: [r.get(k) for r in verl_rows] for k in dict.fromkeys(k for r in verl_rows for k in r)}
        non_finite = sum(o.error is not None and "non-finite" in o.error for o in outcomes)
        metrics = {"reward/failures": float(len(failed) - timeouts), "reward/timeouts": float(timeouts),
                   "reward/failure_fraction": len(failed) / max(n, 1), "reward/non_finite": float(non_finite)}
        notice = ""
        if failed:
            notice = (f"{len(failed)} of {n} samples failed to score ({non_finite} non-finite, {timeouts} timed out) "
                      f"and were given reward_model.failure_score={failure_score:g}; first: sample {failed[0]}: "
                      f"{outcomes[failed[0]].error}")
        return RewardResult(place_scores(batch, scores), info, metrics, notice, verl)

    def _shape(self, batch: DataProto, res: RewardResult) -> None:
        """Format bonus and DAPO's overlong penalty, added on the last token like the score."""
        shaping = self.settings.shaping
        if shaping.format_kind != "none":
            _, responses = decode_texts(batch, self.tokenizer)
            ok = torch.tensor([format_reward(r, shaping.format_kind) for r in responses])
            res.token_level_scores += place_scores(batch, format_bonus(ok, shaping.format_score))
            res.extra_info["format"] = res.reward_extra_info["format"] = ok.tolist()
            res.metrics["reward/format_ok"] = ok.mean().item()
        if shaping.overlong_len is not None and shaping.max_response_length:   # Shaping refuses one without the other
            lens = response_lengths(batch).cpu()
            pen = overlong_penalty(lens, shaping.max_response_length, shaping.overlong_len,
                                   shaping.overlong_penalty_factor)
            res.token_level_scores += place_scores(batch, pen)
            res.extra_info["overlong_reward"] = res.reward_extra_info["overlong_reward"] = pen.tolist()
            res.metrics["reward/overlong_penalty_mean"] = pen.mean().item()
            res.metrics["reward/overlong_ratio"] = (pen < 0).float().mean().item()


def build_reward_manager(cfg: Any, tokenizer: Any, pool: Any = None) -> RewardManager:
    """The manager `cfg` (ExperimentConfig) asks for; starts the Ray pool when
    reward_model.launch_reward_fn_async is set (and no pool is given)."""
    settings = RewardSettings.of(cfg)      # checks the shaping before a pool starts
    return RewardManager(tokenizer, build_scorer(cfg, tokenizer, pool), settings)
