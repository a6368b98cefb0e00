"""Keep a run's whole process tree under one launcher, and end all of it when the launcher ends.

    python -m megarl.parallel.supervise -- torchrun ...   # what launch/torchrun.sh runs
    code = run_tree(cmd, env, sinks)                       # megarl-train's own launch (megarl/train.py)

Three mechanisms, each for a hole the others leave (Linux; elsewhere only the last one's
waiting applies):
- PR_SET_PDEATHSIG on this process (SIGTERM when the shell script above it dies, even by kill -9)
  and on its child (torchrun or the single rank; SIGTERM when this process dies). torchrun turns a
  SIGTERM into a killpg of every rank's process group, which holds the processes a rank forks.
- PR_SET_CHILD_SUBREAPER: a process orphaned under the tree (a checkpoint writer a rank forked,
  after that rank was SIGKILLed) is re-parented here instead of to init, so it can still be found.
- When the child exits (or this process is told to stop), every process still below this one is
  sent SIGTERM, then SIGKILL after a grace period; the output pipe is read with a timeout, so a
  leftover holder of its write end cannot keep the launcher (and the run-directory lock) forever.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import subprocess
import sys
import time
from typing import Callable

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 5.0         # SIGTERM -> SIGKILL for what is left below us
DRAIN_S = 2.0         # output still arriving after the child exited (its last words)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent_term() -> None:
    """SIGTERM (handled: it ends the tree below) when the process that started us dies."""
    parent = os.getppid()
    if _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _child_preexec() -> None:
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def descendants() -> list:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def end_tree(grace_s: float = GRACE_S) -> int:
    """SIGTERM every process below this one, SIGKILL what is left after `grace_s`; reap them.
    Returns how many were still running."""
    procs = descendants()
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive + descendants():     # and anything re-parented to us meanwhile
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    _reap()
    return len(procs)


def _reap() -> None:
    """Collect exit statuses of orphans re-parented to us (a subreaper must, or they stay zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


FALLOC_FL_KEEP_SIZE = 1
RESERVE = 1 << 20     # bytes of disk kept allocated ahead of a log's end


class LogCopy:
    """The launcher's log file, written as output arrives. Disk blocks are reserved ahead of the
    end (fallocate, KEEP_SIZE), so a disk that fills up during the run (a checkpoint) still takes
    the ranks' last lines; a write that fails anyway is one line on stderr, never a traceback."""

    def __init__(self, path: str):
        self.path, self.size, self.reserved = path, 0, 0
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fd: int | None = fd
        self.size = os.fstat(fd).st_size
        self._reserve()

    def _reserve(self) -> None:
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        if libc.fallocate(self.fd, FALLOC_FL_KEEP_SIZE, self.size, RESERVE) == 0:
            self.reserved = self.size + RESERVE

    def write(self, chunk: bytes) -> None:
        if self.fd is None:
            return
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view):]
            self.size += len(chunk)
            if self.size > self.reserved - RESERVE // 2:
                self._reserve()
        except OSError as err:
            print(f"megarl: the log {self.path} stopped at {self.size} bytes ({err.strerror}); the console "
                  "has the rest", file=sys.stderr, flush=True)
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, os.fstat(self.fd).st_size)   # gives the reserve back
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


class Stop(Exception):
    """This launcher was told to stop (SIGTERM / SIGUSR1 / SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum, frame):
    raise Stop(signum)


# The ranks stop at their next step boundary on these, save and exit 143 (megarl/trainer/control/stopping.py).
# They go to the ranks themselves: torchrun would turn them into a SIGKILL of its workers 30 s later.
GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)


def _ranks_of(proc: subprocess.Popen, cmd: list[str]) -> list:
    """The rank processes: torchrun's children, or the child itself when it is the only rank."""
    try:
        child = psutil.Process(proc.pid)
        torchrun = "torch.distributed.run" in cmd or "megarl.parallel.torchrun" in cmd
        return child.children() if torchrun else [child]
    except psutil.NoSuchProcess:
        return []


def start_child(cmd: list[str], env: dict | None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """`cmd` started as run_tree runs it: stdout + stderr on one pipe, SIGTERM when this process dies."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                            preexec_fn=_child_preexec if sys.platform.startswith("linux") else None)


def run_tree(cmd: list[str], env: dict | None, sink: Callable[[bytes], None],
             started: subprocess.Popen | None = None) -> int:
    """Run `cmd`, handing its output (stdout + stderr) to `sink`; end the whole tree below us when
    it exits, fails or we are stopped. Returns the child's exit code (128+N for signal N).
    `started`: `cmd` already running, from start_child (megarl-train starts torchrun during its checks)."""
    become_subreaper()
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    proc = started or start_child(cmd, env)
    assert proc.stdout is not None         # stdout=PIPE
    fd = proc.stdout.fileno()
    stopped = 0
    try:
        try:
            _pump(proc, fd, sink)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)       # torchrun stops its ranks itself; then the drain
            _pump(proc, fd, sink)
        except Stop as stop:
            if stop.signum not in GRACEFUL:
                proc.terminate()
                _pump(proc, fd, sink)
            else:       # the ranks save at a step boundary and leave; a second signal ends the tree at once
                for rank in _ranks_of(proc, cmd):
                    try:
                        rank.send_signal(stop.signum)
                    except psutil.NoSuchProcess:
                        pass
                _pump(proc, fd, sink)
                stopped = stop.signum
    finally:
        end_tree()
        proc.stdout.close()
        for s, h in old.items():
            signal.signal(s, h)
    code = proc.wait()
    if stopped and code:
        return 128 + signal.SIGTERM      # the ranks' 143 (saved at a stop signal); torchrun itself says 1
    return 128 - code if code < 0 else code


def _pump(proc: subprocess.Popen, fd: int, sink: Callable[[bytes], None]) -> None:
    """Copy output until the child has exited and the pipe is drained (or nothing more came for
    DRAIN_S: a leftover process holds the pipe's write end and may never close it)."""
    exited_at = None
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break                              # every writer is gone
            sink(chunk)
            continue
        if exited_at is None and proc.poll() is not None:
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > DRAIN_S:
            break
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m megarl.parallel.supervise -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    die_with_parent_term()

    def write(chunk: bytes) -> None:
        try:
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            pass                                   # tee died with the script: keep ending the tree
    return run_tree(argv, None, write)


if __name__ == "__main__":
    sys.exit(main())
