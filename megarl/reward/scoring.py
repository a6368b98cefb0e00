"""One sample's scoring: call the function, normalise what it returns, contain its failures."""
from __future__ import annotations

import math
import signal
import threading
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
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score ({score})")
    if "score" in info:
        info["score"] = score
    return score, info


class _Timeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _Timeout()


def call_in_process(fn, sample: Sample, extra_kwargs: dict, timeout_s: float | None) -> Outcome:
    """Score one sample here. On the main thread a SIGALRM timer bounds Python code (a call stuck
    inside C code is only bounded by the Ray pool, which can kill its worker)."""
    use_alarm = (bool(timeout_s) and threading.current_thread() is threading.main_thread()
                 and hasattr(signal, "setitimer"))
    previous = signal.signal(signal.SIGALRM, _raise_timeout) if use_alarm else None
    try:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        score, info = normalise(fn(**sample.kwargs(), **extra_kwargs))
        return Outcome(score, info)
    except _Timeout:
        return Outcome(None, error=f"timed out after {timeout_s:g}s", timed_out=True)
    except Exception as err:  # the user's function: any failure is contained and counted
        return Outcome(None, error=f"{type(err).__name__}: {err}")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
