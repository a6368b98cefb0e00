"""torchrun's agent, started while megarl-train checks the run and held until the checks pass.

    agent = HeldTorchrun.start(env)          # right after the config loads (megarl/train.py)
    proc = agent.go(torchrun_argv, env)      # checks passed, run directory locked: its ranks start
    agent.cancel()                           # refused: it ends, no rank started

The agent's own start-up is torch's import, about 2 s on 2 cores; the launcher's data checks load
transformers and torch for about 5 s. Held, the two run side by side on separate cores instead of
one after the other. The agent starts no rank before go(): a refused run still starts none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from megarl.parallel.supervise import start_child

TORCHRUN = [sys.executable, "-m", "megarl.parallel.torchrun"]


class HeldTorchrun:
    def __init__(self, proc: subprocess.Popen | None, go_fd: int | None, env: dict[str, str]):
        self.proc, self._go_fd, self._env = proc, go_fd, env

    @classmethod
    def start(cls, env: dict[str, str]) -> HeldTorchrun:
        """The agent, loading torch, with `env`: the ranks' environment less what the launcher
        only knows later (its lock, the records file); go() sends the difference."""
        read, write = os.pipe()
        try:
            proc = start_child([*TORCHRUN, "--held", str(read)], env, pass_fds=(read,))
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        return cls(proc, write, env)

    @classmethod
    def none(cls) -> HeldTorchrun:
        """Nothing held: go() returns None and the caller starts torchrun itself."""
        return cls(None, None, {})

    def go(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """Send torchrun its arguments and `env` (as a change to the one it started with); the
        running agent, or None when there is none or it has already ended (the caller then starts
        torchrun afresh, which says why it cannot run)."""
        proc, fd = self.proc, self._go_fd
        self.proc, self._go_fd = None, None
        if proc is None or fd is None:
            return None
        change = {"argv": argv, "set": {k: v for k, v in env.items() if self._env.get(k) != v},
                  "unset": sorted(set(self._env) - set(env))}
        if proc.poll() is not None:              # it ended while held (a broken torch install)
            os.close(fd)
            _end(proc)
            return None
        try:
            with os.fdopen(fd, "wb") as f:          # one line; closed at once
                f.write(json.dumps(change).encode() + b"\n")
        except BrokenPipeError:                     # it ended unread: nothing of this run started
            _end(proc)
            return None
        return proc

    def cancel(self) -> None:
        """End the agent (a refused run, or an error before go): it has started nothing."""
        if self._go_fd is not None:
            os.close(self._go_fd)
        if self.proc is not None:
            _end(self.proc)
        self.proc, self._go_fd = None, None


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
