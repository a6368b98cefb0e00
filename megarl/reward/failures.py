"""How a reward step fails: the errors that stop a run naming the reward, the deadline's one line,
and the daemon thread a reward call runs in (megarl/reward/manager.py uses them)."""
from __future__ import annotations

import concurrent.futures as cf
import threading

from megarl.reward.scoring import Sample


class RewardFailure(RuntimeError):
    """Too many samples of a batch failed to score; the run stops with this one-line message."""


class RewardDeadline(RewardFailure):
    """The reward step of one batch passed reward_model.batch_deadline_s."""


def slowest_samples(samples: list[Sample], seconds: dict[int, float], running: set[int], k: int = 3) -> str:
    """'#12 (data_source gsm8k) 31.0s still running, #3 (gsm8k) 2.1s' for the k slowest samples."""
    order = sorted(seconds, key=lambda i: (i not in running, -seconds[i]))[:k]
    return ", ".join(f"#{i} (data_source {samples[i].data_source}) {seconds[i]:.1f}s"
                     + (" still running" if i in running else "") for i in order) or "none started"


def deadline_error(what: str, deadline_s: float | None, n: int, done: int | None, slowest: str) -> RewardDeadline:
    scored = f"{done} of {n} scored; " if done is not None else ""
    deadline = "none" if deadline_s is None else f"{deadline_s:g}s"
    return RewardDeadline(f"the reward step passed reward_model.batch_deadline_s={deadline} on a batch of {n} "
                          f"samples, scoring with {what}; {scored}slowest: {slowest}; fix the function (or give it "
                          "reward_model.launch_reward_fn_async=true, whose workers are killed at timeout_s) or raise "
                          "the deadline")


def in_daemon_thread(fn) -> cf.Future:
    """Run fn() in a daemon thread: a reward call stuck past the deadline must not keep the
    process alive at exit (a ThreadPoolExecutor's threads are joined at interpreter exit)."""
    fut: cf.Future = cf.Future()

    def work() -> None:
        try:
            fut.set_result(fn())
        except BaseException as err:  # handed to the waiting thread
            fut.set_exception(err)
    threading.Thread(target=work, name="megarl-reward", daemon=True).start()
    return fut
