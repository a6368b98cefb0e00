"""torchrun for megarl-train's own launch: torch.distributed.run's main, then a quick exit.

    python -m megarl.parallel.torchrun --rdzv-backend=static ... -m megarl.train ...
    python -m megarl.parallel.torchrun --held FD     (megarl-train: its arguments come later on FD)

The same agent, flags and exit codes as `python -m torch.distributed.run`; once its ranks have ended
it leaves through lifecycle.exit_now rather than tearing down a loaded torch (~0.7 s a launch).
Held, it loads torch while megarl-train checks the run (megarl/launcher/held.py), then reads its
arguments and environment from FD as one line of JSON; FD closed with nothing on it (the run was
refused, or the launcher died) ends it with exit code 0, no rank started.
"""
from __future__ import annotations

import json
import os
import sys

from torch.distributed.run import main

from megarl.parallel.lifecycle import exit_now


def held_args(fd: int) -> list[str] | None:
    """The arguments the launcher sends on `fd` (JSON, never pickle), with its environment applied
    as a change to this process's own: `set` and `unset`. None: the launcher sent nothing."""
    with os.fdopen(fd, "rb") as f:
        sent = f.readline()       # one line, not to the end: a process the launcher forked may hold the pipe
    if not sent:
        return None
    go = json.loads(sent)
    for key in go["unset"]:
        os.environ.pop(key, None)
    os.environ.update(go["set"])
    return list(go["argv"])


if __name__ == "__main__":
    args = None
    if sys.argv[1:2] == ["--held"]:
        args = held_args(int(sys.argv[2]))
        if args is None:
            exit_now(0)
    main(args)                # a failed rank raises ChildFailedError: torchrun's own traceback and exit 1
    exit_now(0)
