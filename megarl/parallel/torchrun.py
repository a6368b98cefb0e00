"""torchrun for megarl-train's own launch: torch.distributed.run's main, then a quick exit.

    python -m megarl.parallel.torchrun --rdzv-backend=static ... -m megarl.train ...

The same agent, flags and exit codes as `python -m torch.distributed.run`; once its ranks have ended
it leaves through lifecycle.exit_now rather than tearing down a loaded torch (~0.7 s a launch).
"""
from __future__ import annotations

from torch.distributed.run import main

from megarl.parallel.lifecycle import exit_now

if __name__ == "__main__":
    main()                    # a failed rank raises ChildFailedError: torchrun's own traceback and exit 1
    exit_now(0)
