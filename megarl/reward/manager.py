"""Reward managers: a rolled-out batch in, token-level scores and per-sample info out.

    manager = build_reward_manager(cfg, tokenizer)
    future = manager.compute_async(batch)       # returns at once with the Ray pool
    ...                                         # reference / critic passes run meanwhile
    result = manager.result(future)             # RewardResult
    result.apply(batch)                         # token_level_scores [B, R] + info fields in the batch

Kinds (`reward_model.reward_manager`):
  naive   one compute_score call per sample (built-in rules or custom_reward_function), in this
          process with a SIGALRM timeout, or in a Ray actor pool when launch_reward_fn_async
  batch   one call with lists for the whole batch (custom_reward_function, batched signature)
  a class `pkg.module:Class` / `file.py:Class`, constructed with reward_manager_kwargs (plus
          tokenizer, compute_score, reward_fn_key if its __init__ takes them) and called with the
          DataProto as in verl; it returns a tensor [B] (placed on the last response token),
          a token-level tensor [B, R], a list of floats, or {"reward_tensor", "reward_extra_info"}.
A batch that already holds `rm_scores` (a reward model's output, [B] or [B, R]) uses those.
"""
from __future__ import annotations

import concurrent.futures as cf
import inspect
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megarl.algos.dapo import overlong_penalty
from megarl.config.errors import ConfigError
from megarl.parallel.actor_pool import PoolDeadline
from megarl.parallel.lifecycle import tell_launcher
from megarl.reward.failures import (RewardDeadline, RewardFailure, deadline_error, in_daemon_thread,  # noqa: F401
                                    slowest_samples)
from megarl.protocol import DataProto
from megarl.config.plugins import construct, load_class
from megarl.reward.loading import RewardFnSpec, load_reward_fn
from megarl.reward.placement import place_scores, response_lengths
from megarl.reward.pool import RayScoringPool
from megarl.reward.rules import check_data_sources, format_reward
from megarl.reward.scoring import (Outcome, RewardExit, Sample, call_in_process, exits_refused, hard_exit,
                                   normalise)

# How long past reward_model.batch_deadline_s a reward call that ignores its SIGALRM (it swallows the
# exception, or is stuck in C code) may keep rank 0 before the rank ends itself naming the deadline;
# its peers would otherwise wait out trainer.collective_timeout_s and blame a lost connection.
STUCK_GRACE_S = 5.0


EXTRA_COLUMN = "reward_extra_info"   # the batch's per-row column of verl's reward_extra_info


@dataclass
class RewardResult:
    token_level_scores: torch.Tensor               # [B, R], each score on its response's last token
    extra_info: dict[str, list] = field(default_factory=dict)   # per-sample fields (acc, pred, ...)
    metrics: dict[str, float] = field(default_factory=dict)
    notice: str = ""                               # samples that failed to score, for the console
    # verl's reward_extra_info, per sample: a dict result's every key (score included), a number as
    # {"acc": score}, plus megarl's shaping fields; what the dumps and val-aux/* metrics show.
    reward_extra_info: dict[str, list] = field(default_factory=dict)

    def apply(self, batch) -> None:
        batch.batch["token_level_scores"] = self.token_level_scores
        for key, values in self.extra_info.items():
            batch.non_tensor_batch[key] = np.array(values, dtype=object)
        # One per-row dict column, so rows selected or concatenated (DAPO's rounds) keep theirs.
        n = self.token_level_scores.shape[0]
        column = np.empty(n, dtype=object)
        column[:] = [{k: v[i] for k, v in self.reward_extra_info.items()} for i in range(n)]
        batch.non_tensor_batch[EXTRA_COLUMN] = column


@dataclass
class RewardFuture:
    future: cf.Future
    batch: Any
    started: float


def ground_truth_of(row: Any) -> Any:
    return row.get("ground_truth") if isinstance(row, dict) else row


class RewardManager:
    def __init__(self, tokenizer, fn_spec: RewardFnSpec | None = None, *, kind: str = "naive",
                 custom: Any = None, reward_fn_key: str = "data_source", failure_score: float = 0.0,
                 max_failure_fraction: float = 0.9, timeout_s: float | None = 10.0, pool: Any = None,
                 format_kind: str = "none", format_score: float = 0.0, overlong: Any = None,
                 max_response_length: int | None = None, deadline_s: float | None = None):
        self.tokenizer, self.kind, self.custom = tokenizer, kind, custom
        self.spec = fn_spec or RewardFnSpec()
        self.fn = self.spec.load() if custom is None else None
        self.reward_fn_key, self.failure_score = reward_fn_key, failure_score
        self.max_failure_fraction, self.timeout_s, self.pool = max_failure_fraction, timeout_s, pool
        self.format_kind, self.format_score = format_kind, format_score
        self.overlong, self.max_response_length = overlong, max_response_length
        if overlong is not None and overlong.enable and not max_response_length:
            raise ConfigError("overlong_buffer needs the response budget (data.max_response_length)",
                              "algorithm.overlong_buffer.enable")
        self.deadline_s = deadline_s
        self.totals = {"failures": 0, "timeouts": 0}

    @property
    def scorer(self) -> str:
        """What scores, for error lines: the user's function or class, or the built-in rules."""
        if self.custom is not None:
            cls = type(self.custom)
            try:            # the file the user named (a file's module gets a generated name)
                where = f"{inspect.getsourcefile(cls)}:"
            except TypeError:
                where = f"{cls.__module__}."
            return f"reward_model.reward_manager {where}{cls.__name__}"
        if self.spec.is_default:
            return "megarl's built-in rules (megarl/reward/rules.py)"
        return f"custom_reward_function {self.spec.path}:{self.spec.name}"

    # -- the API the loop calls -------------------------------------------------------------------
    def __call__(self, batch) -> RewardResult:
        return self.result(self.compute_async(batch))

    def compute_async(self, batch) -> RewardFuture:
        """Start scoring. With a Ray pool or a custom class this returns at once and the work
        runs in a background thread; in-process per-sample scoring runs now (its timeout needs
        the main thread)."""
        started = time.perf_counter()
        if "rm_scores" in batch.batch:
            fut: cf.Future = cf.Future()
            fut.set_result(("rm", batch.batch["rm_scores"]))
        elif self.custom is not None:
            fut = in_daemon_thread(lambda: ("custom", self._call_custom(batch)))
        else:
            samples = self._samples(batch)
            if self.kind == "batch":
                fut = in_daemon_thread(lambda: ("outcomes", self._score_batched(samples)))
            elif self.pool is not None:
                deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
                fut = in_daemon_thread(lambda: ("outcomes", self._score_in_pool(samples, deadline)))
            else:
                fut = cf.Future()
                try:
                    fut.set_result(("outcomes", self._score_in_process(samples)))
                except BaseException as err:   # raised by result(), where the loop hands it to every rank
                    fut.set_exception(err)
        return RewardFuture(fut, batch, started)

    def _call_custom(self, batch):
        view = self._with_text(batch)
        with exits_refused():
            return self.custom(view)

    def _score_in_pool(self, samples: list[Sample], deadline: float | None) -> list[Outcome]:
        try:
            return self.pool.score(samples, deadline=deadline)
        except PoolDeadline as late:          # the pool stays whole for whoever handles the error
            raise deadline_error(self.scorer, self.deadline_s, len(samples), late.done,
                                 slowest_samples(samples, late.seconds, late.running)) from None

    def _score_in_process(self, samples: list[Sample]) -> list[Outcome]:
        """One sample after another, each bounded by timeout_s and by what is left of the deadline
        (SIGALRM); a call that outlives both by STUCK_GRACE_S ends the rank (`_stuck_past_deadline`)."""
        if self.deadline_s is None:
            return self._score_samples(samples)
        watchdog = threading.Timer(self.deadline_s + STUCK_GRACE_S, self._stuck_past_deadline, (len(samples),))
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._score_samples(samples)
        finally:
            watchdog.cancel()

    def _stuck_past_deadline(self, n: int) -> None:
        """Nothing can interrupt the main thread from here, so this rank ends itself with the cause."""
        err = deadline_error(self.scorer, self.deadline_s, n, None, f"a call still running {STUCK_GRACE_S:g}s past "
                             "the deadline, ignoring its timeout (it catches the timeout's exception, or waits in C "
                             "code)")
        print(f"megarl: stopped: {err}", file=sys.stderr, flush=True)
        tell_launcher(err)
        hard_exit(3)

    def _score_samples(self, samples: list[Sample]) -> list[Outcome]:
        begin, seconds, out = time.monotonic(), {}, []
        for i, sample in enumerate(samples):
            left = None if self.deadline_s is None else self.deadline_s - (time.monotonic() - begin)
            if left is not None and left <= 0:
                raise deadline_error(self.scorer, self.deadline_s, len(samples), i,
                                     slowest_samples(samples, seconds, set()))
            limit = self.timeout_s if left is None else min(self.timeout_s or left, left)
            t0 = time.monotonic()
            out.append(call_in_process(self.fn, sample, self.spec.kwargs, limit))
            seconds[i] = time.monotonic() - t0
            if out[-1].timed_out and left is not None and limit == left:
                raise deadline_error(self.scorer, self.deadline_s, len(samples), i,
                                     slowest_samples(samples, seconds, {i}))
        return out

    def result(self, handle: RewardFuture) -> RewardResult:
        left = None if self.deadline_s is None else self.deadline_s - (time.perf_counter() - handle.started)
        try:
            # A little slack: the pool raises its own, more detailed, deadline error first.
            what, value = handle.future.result(timeout=None if left is None else max(left, 0) + 1.0)
        except cf.TimeoutError:
            raise deadline_error(self.scorer, self.deadline_s, len(handle.batch), None,
                                 "the call for the whole batch, still running") from None
        except RewardExit as err:
            raise RewardFailure(f"{self.scorer} {err} while scoring a batch of {len(handle.batch)} samples; a reward "
                                "must return a score (or raise), not end the process") from None
        batch = handle.batch
        if what == "outcomes":
            res = self._from_outcomes(batch, value)
        elif what == "rm":
            res = RewardResult(self._as_token_level(batch, value, "rm_scores"))
        else:
            try:
                res = self._from_custom(batch, value)
            except (TypeError, ValueError) as err:   # the class's output, not megarl: one line naming it
                raise RewardFailure(f"{self.scorer}: {err}") from None
        self._sanitise(res)
        self._shape(batch, res)
        res.metrics["reward/latency_s"] = time.perf_counter() - handle.started  # overlaps the log-prob passes
        return res

    def _sanitise(self, res: RewardResult) -> None:
        """NaN/inf in a tensor a custom manager or reward model returned: counted, told, and given
        reward_model.failure_score (a NaN would reach every advantage of its group)."""
        bad = ~torch.isfinite(res.token_level_scores)
        rows = int(bad.any(-1).sum())
        if rows:
            res.token_level_scores[bad] = self.failure_score
            res.metrics["reward/non_finite"] = res.metrics.get("reward/non_finite", 0.0) + rows
            res.notice = (res.notice + "; " if res.notice else "") + (
                f"{rows} of {bad.shape[0]} samples had a non-finite reward, given reward_model.failure_score="
                f"{self.failure_score:g}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # -- building inputs --------------------------------------------------------------------------
    def _texts(self, batch) -> tuple[list[str], list[str]]:
        resp, lens = batch.batch["responses"], response_lengths(batch).tolist()
        responses = self.tokenizer.batch_decode([r[:n].tolist() for r, n in zip(resp, lens)], skip_special_tokens=True)
        nt = batch.non_tensor_batch
        prompts = (self.tokenizer.batch_decode([list(p) for p in nt["prompt_token_ids"]], skip_special_tokens=True)
                   if "prompt_token_ids" in nt else [""] * len(batch))
        return prompts, responses

    def _samples(self, batch) -> list[Sample]:
        nt = batch.non_tensor_batch
        if "reward_model" not in nt:
            raise ValueError("the batch has no 'reward_model' field with the ground truth; the dataset must give "
                             "reward_model: {ground_truth: ...} (or ground_truth / answer) per row")
        n = len(batch)
        sources = nt.get(self.reward_fn_key, np.array([None] * n, dtype=object))
        if self.spec.is_default:
            check_data_sources(sources, "data.reward_fn_key")
        _, responses = self._texts(batch)
        extra = nt.get("extra_info", np.array([None] * n, dtype=object))
        return [Sample(sources[i], responses[i], ground_truth_of(nt["reward_model"][i]), extra[i]) for i in range(n)]

    def _with_text(self, batch):
        """The batch a custom manager sees: the original plus decoded prompt/response text."""
        prompts, responses = self._texts(batch)
        view = DataProto(batch.batch, dict(batch.non_tensor_batch), batch.meta_info)
        view.non_tensor_batch["prompt_text"] = np.array(prompts, dtype=object)
        view.non_tensor_batch["response_text"] = np.array(responses, dtype=object)
        return view

    # -- turning outputs into scores --------------------------------------------------------------
    def _score_batched(self, samples: list[Sample]) -> list[Outcome]:
        try:
            with exits_refused():
                outs = self.fn(data_sources=[s.data_source for s in samples],
                               solution_strs=[s.solution_str for s in samples],
                               ground_truths=[s.ground_truth for s in samples],
                               extra_infos=[s.extra_info for s in samples], **self.spec.kwargs)
            if len(outs) != len(samples):
                raise ValueError(f"returned {len(outs)} scores for {len(samples)} samples")
        except Exception as err:
            return [Outcome(None, error=f"{type(err).__name__}: {err}")] * len(samples)
        results = []
        for out in outs:
            try:
                results.append(Outcome(*normalise(out)))
            except (TypeError, ValueError) as err:
                results.append(Outcome(None, error=str(err)))
        return results

    def _from_outcomes(self, batch, outcomes: list[Outcome]) -> RewardResult:
        n = len(outcomes)
        failed = [i for i, o in enumerate(outcomes) if o.score is None]
        timeouts = sum(o.timed_out for o in outcomes)
        self.totals["failures"] += len(failed) - timeouts
        self.totals["timeouts"] += timeouts
        if n and len(failed) / n > self.max_failure_fraction:
            first = outcomes[failed[0]]
            raise RewardFailure(f"the reward function failed on {len(failed)} of {n} samples ({timeouts} timed out), "
                                f"more than reward_model.max_failure_fraction={self.max_failure_fraction}; first: "
                                f"sample {failed[0]}: {first.error}")
        scores = [self.failure_score if o.score is None else o.score for o in outcomes]
        keys = sorted({k for o in outcomes for k in o.info} - {"score"})
        info = {k: [o.info.get(k) for o in outcomes] for k in keys}
        info["reward_failed"] = [o.score is None for o in outcomes]
        # verl 0.9.1's reward loop: a dict's keys as returned, a number as acc (a failed sample: failure_score)
        verl_rows = [o.info if "score" in o.info else {"acc": s} for o, s in zip(outcomes, scores)]
        verl = {k: [r.get(k) for r in verl_rows] for k in dict.fromkeys(k for r in verl_rows for k in r)}
        non_finite = sum(bool(o.error) and "non-finite" in o.error for o in outcomes)
        metrics = {"reward/failures": float(len(failed) - timeouts), "reward/timeouts": float(timeouts),
                   "reward/failure_fraction": len(failed) / max(n, 1), "reward/non_finite": float(non_finite)}
        notice = ""
        if failed:
            notice = (f"{len(failed)} of {n} samples failed to score ({non_finite} non-finite, {timeouts} timed out) "
                      f"and were given reward_model.failure_score={self.failure_score:g}; first: sample {failed[0]}: "
                      f"{outcomes[failed[0]].error}")
        return RewardResult(place_scores(batch, scores), info, metrics, notice, verl)

    def _as_token_level(self, batch, value, what: str) -> torch.Tensor:
        if isinstance(value, (list, tuple, np.ndarray)):
            value = torch.as_tensor(np.asarray(value, dtype=np.float32))
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} must be a tensor [B] or [B, R] or a list of floats, got {type(value).__name__}")
        mask = batch.batch["response_mask"]
        value = value.detach().float().cpu()
        if value.dim() == 1 and value.shape[0] == mask.shape[0]:
            return place_scores(batch, value)
        if value.dim() == 2 and value.shape[0] == mask.shape[0]:
            if value.shape[1] != mask.shape[1]:
                raise ValueError(f"{what} has {value.shape[1]} columns but responses have {mask.shape[1]}")
            return value * mask.float().cpu()
        raise ValueError(f"{what} has shape {tuple(value.shape)}; expected [{mask.shape[0]}] or {tuple(mask.shape)}")

    def _from_custom(self, batch, out) -> RewardResult:
        name = type(self.custom).__name__
        info: dict[str, list] = {}
        if isinstance(out, dict):
            if "reward_tensor" not in out:
                raise TypeError(f"{name} returned a dict without 'reward_tensor' (keys: {sorted(out)})")
            info = {k: list(v) for k, v in (out.get("reward_extra_info") or {}).items()}
            out = out["reward_tensor"]
        return RewardResult(self._as_token_level(batch, out, f"{name}(batch)"), info, reward_extra_info=dict(info))

    def _shape(self, batch, res: RewardResult) -> None:
        """Format bonus and DAPO's overlong penalty, added on the last token like the score."""
        if self.format_kind != "none":
            _, responses = self._texts(batch)
            ok = torch.tensor([format_reward(r, self.format_kind) for r in responses])
            res.token_level_scores += place_scores(batch, self.format_score * ok)
            res.extra_info["format"] = res.reward_extra_info["format"] = ok.tolist()
            res.metrics["reward/format_ok"] = ok.mean().item()
        if self.overlong is not None and self.overlong.enable:
            lens = response_lengths(batch).cpu()
            pen = overlong_penalty(lens, self.max_response_length, self.overlong.len, self.overlong.penalty_factor)
            res.token_level_scores += place_scores(batch, pen)
            res.extra_info["overlong_reward"] = res.reward_extra_info["overlong_reward"] = pen.tolist()
            res.metrics["reward/overlong_penalty_mean"] = pen.mean().item()
            res.metrics["reward/overlong_ratio"] = (pen < 0).float().mean().item()


def build_reward_manager(cfg, tokenizer, pool: Any = None) -> RewardManager:
    """The manager `cfg` (ExperimentConfig) asks for; starts the Ray pool when
    reward_model.launch_reward_fn_async is set (and no pool is given)."""
    rm, algo = cfg.reward_model, cfg.algorithm
    common = dict(reward_fn_key=cfg.data.reward_fn_key, failure_score=rm.failure_score,
                  max_failure_fraction=rm.max_failure_fraction, timeout_s=rm.timeout_s, format_kind=rm.format_reward,
                  format_score=rm.format_score, overlong=algo.overlong_buffer,
                  max_response_length=cfg.data.max_response_length, deadline_s=rm.batch_deadline_s)
    kind = rm.reward_manager
    if kind not in ("naive", "batch"):
        cls = load_class(kind, "reward_model.reward_manager", ("naive", "batch"))
        spec = RewardFnSpec(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                            dict(cfg.custom_reward_function.reward_kwargs))
        available = {"tokenizer": tokenizer, "compute_score": spec.load(), "reward_fn_key": cfg.data.reward_fn_key,
                     "num_examine": 0, "config": cfg}
        custom = construct(cls, available, dict(rm.reward_manager_kwargs), "reward_model.reward_manager")
        if not callable(custom):
            raise ConfigError(f"{kind} instances are not callable; define __call__(self, data: DataProto)",
                              "reward_model.reward_manager")
        return RewardManager(tokenizer, spec, kind="custom", custom=custom, **common)
    spec, _ = load_reward_fn(cfg.custom_reward_function, batched=kind == "batch")
    if pool is None and rm.launch_reward_fn_async and kind == "naive":
        pool = RayScoringPool(spec, rm.num_workers, rm.timeout_s)
    return RewardManager(tokenizer, spec, kind=kind, pool=pool, **common)
