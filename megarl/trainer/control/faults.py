"""Named fault points, so the fault suite (tests/faults/) stops a run at an exact place instead
of guessing with sleeps. Nothing happens unless MEGARL_FAULT is set.

    MEGARL_FAULT=pause@save:4        rank 0, at step 4's save point, writes $MEGARL_FAULT_DIR/reached
                                     and waits there (the test then SIGKILLs the whole run)
    MEGARL_FAULT=kill@sync:3:1       rank 1 SIGKILLs itself at step 3's weight sync
    MEGARL_FAULT=enospc@save:4       the save of step 4 fails with ENOSPC (a full disk where the
                                     suite cannot mount a small filesystem)
    MEGARL_FAULT=raise@step:2        a RuntimeError

Points: `step` (after the updates, before the weight sync), `sync` (the weight sync: the trainer
has begun it, the other side is inside it), `save` (the role checkpoints and RNG files are in
global_step_N.tmp; trainer_state.pt, the rename and the pointer are not written yet), `record`
(step N's checkpoint is complete, its metrics record not yet logged), `stream` (a rollout rank
of the disaggregated stream, after a chunk of batch N: responses of N are half done while
finished batches wait in its buffer). The rank is the global rank (0 when not given).
"""
from __future__ import annotations

import errno
import os
import signal
import time

FAULT_ENV = "MEGARL_FAULT"
FAULT_DIR_ENV = "MEGARL_FAULT_DIR"


def fault_point(name: str, step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for item in spec.split(","):
        action, _, where = item.partition("@")
        point, at, *who = where.split(":")
        if point != name or int(at) != step or int(who[0] if who else 0) != rank:
            continue
        if action == "pause":
            # A parked rank never reaches a step boundary: the stop signals end it at once again, as
            # the kill drills expect of a rank torchrun stops (megarl/trainer/control/stopping.py saves instead).
            for stop in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(stop, signal.SIG_DFL)
            marker = os.path.join(os.environ.get(FAULT_DIR_ENV, "."), "reached")
            with open(marker + ".tmp", "w") as f:
                f.write(f"{name}:{step}:{rank}:{os.getpid()}\n")
            os.replace(marker + ".tmp", marker)
            while True:
                time.sleep(3600)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by MEGARL_FAULT)")
        if action == "raise":
            raise RuntimeError(f"injected failure at {name} of step {step} (MEGARL_FAULT)")
        raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {item!r}; use pause, kill, enospc or raise")
