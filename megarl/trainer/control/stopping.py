"""A stop asked for by a signal: SIGTERM (Slurm's preemption and time limit, `kill`, `scancel`) or
SIGUSR1 (what `sbatch --signal=USR1@90` style requeue setups send). The rank saves at the next step
boundary and exits 143 (128 + SIGTERM), so the same command resumes exactly there.

    stop = StopRequest(cfg.trainer.stop_grace_s).install()     # megarl/job/run.py, first thing
    ... after each step: if stop.agreed(group, device): save, then raise Stopped(...)

The ranks agree (one all-reduce per step) because a signal reaches them at different times, or only
some of them. A step that does not end within the grace period cannot be saved: the rank then says
so in one line and exits 143 without a save; the last checkpoint stays the resume point.
"""
from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from megarl.parallel.own_lines import own_line

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 128 + signal.SIGTERM


class Stopped(Exception):
    """The ranks stopped at a step boundary after a stop signal (the message says what was saved)."""


class StopRequest:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum = 0
        self.watchdog: threading.Timer | None = None

    def install(self) -> StopRequest:
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        return self

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def _on_signal(self, signum, frame) -> None:
        if self.signum:
            return                   # torchrun forwards the launcher's signal: one rank may get it twice
        self.signum = signum
        self.watchdog = threading.Timer(self.grace_s, self._grace_passed)
        self.watchdog.daemon = True
        self.watchdog.start()

    def agreed(self, group, device) -> bool:
        """True on every rank once any rank got a stop signal (a collective: every rank calls it)."""
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and not self.signum:
            self.signum = int(flag.item())
        if flag.item() and self.watchdog is not None:
            self.watchdog.cancel()   # the boundary is reached: the save runs to its end
        return bool(flag.item())

    def _grace_passed(self) -> None:
        own_line(f"megarl: stopped by {self.name}: no step ended within trainer.stop_grace_s={self.grace_s:g}s, so "
                 "nothing was saved; the same command resumes from the last checkpoint (raise trainer.stop_grace_s "
                 "to save on a stop)")
        os._exit(EXIT_CODE)      # the main thread may be stuck in a collective: end the process from here
