"""Scorers: what turns a rolled-out batch into scores, one class per way of scoring, behind one protocol.

    scorer = build_scorer(cfg, tokenizer)         # from reward_model.reward_manager and custom_reward_function
    future = scorer.start(batch, deadline_s)      # -> list[Outcome] (one per sample) or RewardResult
    ...
    scorer.close()

  InProcessScorer   naive: built-in rules or custom_reward_function, one call per sample here (SIGALRM timeout)
  PoolScorer        naive with reward_model.launch_reward_fn_async: the same calls in a Ray actor pool
  BatchedScorer     batch: one call with lists for the whole batch
  ClassScorer       `pkg.module:Class` / `file.py:Class`: a user's manager called with the DataProto, as in verl

A new way of scoring is one class with `label`, `start` and `close`; RewardManager (manager.py) turns
outcomes into token-level scores, counts failures and adds shaping the same way for all of them.
"""
from __future__ import annotations

import concurrent.futures as cf
import inspect
import sys
import threading
import time
from typing import Any, Protocol

import numpy as np

from megarl.config.errors import ConfigError
from megarl.config.plugins import construct, load_class
from megarl.parallel.actor_pool import PoolDeadline
from megarl.parallel.lifecycle import tell_launcher
from megarl.protocol import DataProto
from megarl.reward.result import result_of_class
from megarl.reward.failures import RewardFailure, deadline_error, in_daemon_thread, slowest_samples
from megarl.reward.loading import RewardFnSpec, load_reward_fn
from megarl.reward.placement import response_lengths
from megarl.reward.pool import RayScoringPool
from megarl.reward.rules import check_data_sources
from megarl.reward.scoring import Outcome, Sample, call_in_process, exits_refused, hard_exit, normalise

# How long past reward_model.batch_deadline_s a reward call that ignores its SIGALRM (it swallows the
# exception, or is stuck in C code) may keep rank 0 before the rank ends itself naming the deadline;
# its peers would otherwise wait out trainer.collective_timeout_s and blame a lost connection.
STUCK_GRACE_S = 5.0


class Scorer(Protocol):
    label: str            # what scores, for error lines: the user's function or class, or the built-in rules

    def start(self, batch: DataProto, deadline_s: float | None) -> cf.Future:
        """Start scoring; the future holds list[Outcome] (one per row) or a RewardResult. A scorer may
        score before returning (in-process SIGALRM needs the main thread) or in a daemon thread."""

    def close(self) -> None:
        """Release workers (a Ray pool); a no-op for most."""


# -- what every scorer reads from a batch -------------------------------------------------------------
def decode_texts(batch: DataProto, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(prompts, responses) as text; a response up to its length, special tokens skipped."""
    resp, lens = batch.batch["responses"], response_lengths(batch).tolist()
    responses = tokenizer.batch_decode([r[:n].tolist() for r, n in zip(resp, lens)], skip_special_tokens=True)
    nt = batch.non_tensor_batch
    prompts = (tokenizer.batch_decode([list(p) for p in nt["prompt_token_ids"]], skip_special_tokens=True)
               if "prompt_token_ids" in nt else [""] * len(batch))
    return prompts, responses


def ground_truth_of(row: Any) -> Any:
    return row.get("ground_truth") if isinstance(row, dict) else row


def samples_of(batch: DataProto, tokenizer: Any, spec: RewardFnSpec, reward_fn_key: str) -> list[Sample]:
    """One compute_score call's arguments per row."""
    nt = batch.non_tensor_batch
    if "reward_model" not in nt:
        raise ValueError("the batch has no 'reward_model' field with the ground truth; the dataset must give "
                         "reward_model: {ground_truth: ...} (or ground_truth / answer) per row")
    n = len(batch)
    sources = nt.get(reward_fn_key, np.array([None] * n, dtype=object))
    if spec.is_default:
        check_data_sources(sources, "data.reward_fn_key")
    _, responses = decode_texts(batch, tokenizer)
    extra = nt.get("extra_info", np.array([None] * n, dtype=object))
    return [Sample(sources[i], responses[i], ground_truth_of(nt["reward_model"][i]), extra[i]) for i in range(n)]


def function_label(spec: RewardFnSpec) -> str:
    if spec.is_default:
        return "megarl's built-in rules (megarl/reward/rules.py)"
    return f"custom_reward_function {spec.path}:{spec.name}"


# -- the scorers ----------------------------------------------------------------------------------------
class InProcessScorer:
    """One sample after another in this process, each bounded by timeout_s and by what is left of the
    deadline (SIGALRM); a call that outlives both by STUCK_GRACE_S ends the rank (`_stuck_past_deadline`)."""

    def __init__(self, tokenizer: Any, spec: RewardFnSpec | None = None, *, reward_fn_key: str = "data_source",
                 timeout_s: float | None = 10.0):
        self.tokenizer, self.spec = tokenizer, spec or RewardFnSpec()
        self.fn, self.reward_fn_key, self.timeout_s = self.spec.load(), reward_fn_key, timeout_s
        self.label = function_label(self.spec)

    def start(self, batch: DataProto, deadline_s: float | None) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(self._score(samples_of(batch, self.tokenizer, self.spec, self.reward_fn_key), deadline_s))
        except BaseException as err:   # raised by the manager's result(), where the loop hands it to every rank
            fut.set_exception(err)
        return fut

    def _score(self, samples: list[Sample], deadline_s: float | None) -> list[Outcome]:
        if deadline_s is None:
            return self._score_samples(samples, None)
        watchdog = threading.Timer(deadline_s + STUCK_GRACE_S, self._stuck_past_deadline, (len(samples), deadline_s))
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._score_samples(samples, deadline_s)
        finally:
            watchdog.cancel()

    def _stuck_past_deadline(self, n: int, deadline_s: float) -> None:
        """Nothing can interrupt the main thread from here, so this rank ends itself with the cause."""
        err = deadline_error(self.label, deadline_s, n, None, f"a call still running {STUCK_GRACE_S:g}s past "
                             "the deadline, ignoring its timeout (it catches the timeout's exception, or waits in C "
                             "code)")
        print(f"megarl: stopped: {err}", file=sys.stderr, flush=True)
        tell_launcher(err)
        hard_exit(3)

    def _score_samples(self, samples: list[Sample], deadline_s: float | None) -> list[Outcome]:
        begin, out = time.monotonic(), []
        seconds: dict[int, float] = {}
        for i, sample in enumerate(samples):
            left = None if deadline_s is None else deadline_s - (time.monotonic() - begin)
            if left is not None and left <= 0:
                raise deadline_error(self.label, deadline_s, len(samples), i, slowest_samples(samples, seconds, set()))
            limit = self.timeout_s if left is None else min(self.timeout_s or left, left)
            t0 = time.monotonic()
            out.append(call_in_process(self.fn, sample, self.spec.kwargs, limit))
            seconds[i] = time.monotonic() - t0
            if out[-1].timed_out and left is not None and limit == left:
                raise deadline_error(self.label, deadline_s, len(samples), i, slowest_samples(samples, seconds, {i}))
        return out

    def close(self) -> None:
        pass


class PoolScorer:
    """The per-sample calls in a Ray actor pool, while the reference / critic passes run."""

    def __init__(self, tokenizer: Any, spec: RewardFnSpec, pool: Any, *, reward_fn_key: str = "data_source"):
        self.tokenizer, self.spec, self.pool, self.reward_fn_key = tokenizer, spec, pool, reward_fn_key
        self.label = function_label(spec)

    def start(self, batch: DataProto, deadline_s: float | None) -> cf.Future:
        samples = samples_of(batch, self.tokenizer, self.spec, self.reward_fn_key)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s

        def score() -> list[Outcome]:
            try:
                return self.pool.score(samples, deadline=deadline)
            except PoolDeadline as late:          # the pool stays whole for whoever handles the error
                raise deadline_error(self.label, deadline_s, len(samples), late.done,
                                     slowest_samples(samples, late.seconds, late.running)) from None
        return in_daemon_thread(score)

    def close(self) -> None:
        self.pool.close()


class BatchedScorer:
    """One call with lists for the whole batch; its failure is every sample's."""

    def __init__(self, tokenizer: Any, spec: RewardFnSpec, *, reward_fn_key: str = "data_source"):
        self.tokenizer, self.spec, self.reward_fn_key = tokenizer, spec, reward_fn_key
        self.fn, self.label = spec.load(), function_label(spec)

    def start(self, batch: DataProto, deadline_s: float | None) -> cf.Future:
        samples = samples_of(batch, self.tokenizer, self.spec, self.reward_fn_key)
        return in_daemon_thread(lambda: self._score(samples))

    def _score(self, samples: list[Sample]) -> list[Outcome]:
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

    def close(self) -> None:
        pass


class ClassScorer:
    """A user's manager instance, called with the batch plus decoded prompt_text / response_text."""

    def __init__(self, tokenizer: Any, instance: Any):
        self.tokenizer, self.instance = tokenizer, instance
        cls = type(instance)
        try:            # the file the user named (a file's module gets a generated name)
            where = f"{inspect.getsourcefile(cls)}:"
        except TypeError:
            where = f"{cls.__module__}."
        self.label = f"reward_model.reward_manager {where}{cls.__name__}"

    def start(self, batch: DataProto, deadline_s: float | None) -> cf.Future:
        return in_daemon_thread(lambda: self._score(batch))

    def _score(self, batch: DataProto):
        prompts, responses = decode_texts(batch, self.tokenizer)
        view = DataProto(batch.batch, dict(batch.non_tensor_batch), batch.meta_info)
        view.non_tensor_batch["prompt_text"] = np.array(prompts, dtype=object)
        view.non_tensor_batch["response_text"] = np.array(responses, dtype=object)
        with exits_refused():
            out = self.instance(view)
        try:
            return result_of_class(batch, out, type(self.instance).__name__)
        except (TypeError, ValueError) as err:   # the class's output, not megarl: one line naming it
            raise RewardFailure(f"{self.label}: {err}") from None

    def close(self) -> None:
        pass


def build_scorer(cfg: Any, tokenizer: Any, pool: Any = None) -> Scorer:
    """The scorer `cfg` (ExperimentConfig) asks for; starts the Ray pool when
    reward_model.launch_reward_fn_async is set (and no pool is given)."""
    rm, key = cfg.reward_model, cfg.data.reward_fn_key
    kind = rm.reward_manager
    if kind not in ("naive", "batch"):
        cls = load_class(kind, "reward_model.reward_manager", ("naive", "batch"))
        fn = cfg.custom_reward_function
        spec = RewardFnSpec(fn.path, fn.name, dict(fn.reward_kwargs))
        available = {"tokenizer": tokenizer, "compute_score": spec.load(), "reward_fn_key": key,
                     "num_examine": 0, "config": cfg}
        instance = construct(cls, available, dict(rm.reward_manager_kwargs), "reward_model.reward_manager")
        if not callable(instance):
            raise ConfigError(f"{kind} instances are not callable; define __call__(self, data: DataProto)",
                              "reward_model.reward_manager")
        return ClassScorer(tokenizer, instance)
    spec, _ = load_reward_fn(cfg.custom_reward_function, batched=kind == "batch")
    if kind == "batch":
        return BatchedScorer(tokenizer, spec, reward_fn_key=key)
    if pool is None and rm.launch_reward_fn_async:
        pool = RayScoringPool(spec, rm.num_workers, rm.timeout_s)
    if pool is not None:
        return PoolScorer(tokenizer, spec, pool, reward_fn_key=key)
    return InProcessScorer(tokenizer, spec, reward_fn_key=key, timeout_s=rm.timeout_s)
