"""One sample's scoring: call the function, normalise what it returns, contain its failures."""
from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """The keyword arguments of one compute_score call."""
    data_source: Any
    solution_str: str
    ground_truth: Any
    extra_info: Any = None

    def kwargs(self) -> dict:
        return {"data_source": self.data_source, "solution_str": self.solution_str,
                "ground_truth": self.ground_truth, "extra_info": self.extra_info}


@dataclass
class Outcome:
    score: float | None                    # None when the call failed or timed out
    info: dict = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


def normalise(out: Any) -> tuple[float, dict]:
    """A float/int/bool, or a dict with a numeric `score` (other keys are per-sample info). A dict's
    info keeps its `score` too: verl's reward_extra_info holds a dict's every key, and a number as `acc`,
    so the dumps and val-* metrics need to know which of the two the function returned."""
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"reward function returned a dict without 'score' (keys: {sorted(out)})")
        info = dict(out)
        score = out["score"]
    else:
        info, score = {}, out
    if hasattr(score, "item"):
        score = score.item()
    if not isinstance(score, (bool, int, float)):
        raise TypeError(f"reward function returned {type(score).__name__}; return a float or a dict with 'score'")
    try:
        score = float(score)
    except OverflowError:       # an int past float range (10**400): a cause, not a traceback from float()
        raise ValueError(f"reward function returned an integer of {score.bit_length()} bits, beyond a float's "
                         "range (about 1.8e308); return a float") from None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score ({score})")
    if "score" in info:
        info["score"] = score
    return score, info


class _Timeout(BaseException):
    """BaseException: a reward's own `except Exception` must not swallow its timeout."""


class RewardExit(BaseException):
    """A reward function tried to end its process (sys.exit, os._exit). BaseException, so neither the
    per-sample containment nor a user's `except Exception` takes it: the run stops, naming the reward."""


_REAL_EXIT = os._exit
_guarded_threads: set[int] = set()
# A process forked while a reward is scored (its own multiprocessing) ends with os._exit: in the
# child that must end the child, whatever thread ident it inherited.
os.register_at_fork(after_in_child=_guarded_threads.clear)


def _exit_unless_scoring(code=0):
    if threading.get_ident() in _guarded_threads:
        raise RewardExit(f"called os._exit({code})")
    _REAL_EXIT(code)


@contextmanager
def exits_refused():
    """sys.exit and os._exit from this thread raise RewardExit inside the block. A rank that ends
    there would leave its peers only a lost connection to report, and exit code 0 reads as success.
    os._exit is replaced once for the process; outside a scoring thread it ends the process as before."""
    os._exit = _exit_unless_scoring
    me = threading.get_ident()
    _guarded_threads.add(me)
    try:
        yield
    except SystemExit as err:
        raise RewardExit(f"called sys.exit({err.code!r})") from None
    finally:
        _guarded_threads.discard(me)


def hard_exit(code: int) -> None:
    """End this process now (os._exit as the interpreter gave it)."""
    _REAL_EXIT(code)


def _raise_timeout(signum, frame):
    raise _Timeout()


def call_in_process(fn, sample: Sample, extra_kwargs: dict, timeout_s: float | None) -> Outcome:
    """Score one sample here. On the main thread a SIGALRM timer bounds Python code (a call stuck
    inside C code is only bounded by the Ray pool, which can kill its worker)."""
    use_alarm = (bool(timeout_s) and threading.current_thread() is threading.main_thread()
                 and hasattr(signal, "setitimer"))
    previous = signal.signal(signal.SIGALRM, _raise_timeout) if use_alarm else None
    try:
        if use_alarm and timeout_s:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        with exits_refused():
            out = fn(**sample.kwargs(), **extra_kwargs)
        score, info = normalise(out)
        return Outcome(score, info)
    except _Timeout:
        return Outcome(None, error=f"timed out after {timeout_s:g}s", timed_out=True)
    except Exception as err:  # the user's function: any failure is contained and counted
        return Outcome(None, error=f"{type(err).__name__}: {err}")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
