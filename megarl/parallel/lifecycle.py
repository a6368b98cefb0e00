"""Process lifetime: ranks that die with their launcher (and tell it why), and one writer per run directory.

    die_with_parent()                 # in a rank: SIGKILL when the process that started it dies
    lock = RunDirLock(run_dir)        # raises ConfigError naming the holder's pid and host
    lock.acquire(); ...; lock.release()
    exit_now(code)                    # a finished process: leave without tearing the interpreter down

torchrun (and `megarl-train`'s own launch) start ranks in new sessions, so a `kill -9` of the
launcher used to leave them running, finishing a run while a restarted one wrote into the same
directory. The parent-death signal ends them instead; the lock stops a second writer at once.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import fcntl
import gc
import io
import json
import os
import signal
import socket
import stat
import sys
import threading
import time

from megarl.config.errors import ConfigError
from megarl.storage.durable import make_private_dir

PR_SET_PDEATHSIG = 1
LOCK_NAME = ".megarl.lock"
# Set by a launcher that holds the lock for the ranks it starts (they must not take it again).
LOCK_HELD_ENV = "MEGARL_RUN_LOCK_HELD"


def die_with_parent(sig: int = signal.SIGKILL) -> str:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux prctl), else
    watch the parent's pid from a daemon thread. Returns which mechanism is in place."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os.kill(os.getpid(), sig)
            return "prctl"

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="megarl-parent-watch", daemon=True).start()
    return "watchdog"


class RunDirLock:
    """An exclusive flock on <run_dir>/.megarl.lock, which holds "pid host" of the holder.
    The kernel drops it when the holder exits, however it exits (no stale locks after kill -9).
    flock is per host on some network filesystems; the pid/host text still names the holder."""

    def __init__(self, run_dir: str, key: str = "trainer.default_local_dir"):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.key = key
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        make_private_dir(os.path.dirname(self.path))
        try:
            # O_NOFOLLOW: a symlink planted at the lock's name is refused, not followed and truncated.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise ConfigError(f"{self.path} is a symbolic link; megarl will not follow it (someone else may have "
                              "planted it). Remove it, and check who can write to the run directory",
                              self.key) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"{self.path} is not a regular file; remove it", self.key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            os.close(fd)
            pid, host = (holder + ["?", "?"])[:2]
            raise ConfigError(f"{os.path.dirname(self.path)} is in use by another run (pid {pid} on host {host}); "
                              "wait for it or stop it, or give this run its own trainer.default_local_dir",
                              self.key) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        os.environ[LOCK_HELD_ENV] = self.path
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (its text is only informative)
            self.fd = None
            os.environ.pop(LOCK_HELD_ENV, None)


def tell_launcher(err: BaseException) -> None:
    """Write this rank's cause into torchrun's error file. A rank that returns an exit code leaves
    none, and torchrun's summary would then blame a peer's later "connection closed" instead."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")   # set by torchrun; absent otherwise
    if not path:
        return
    # torch's ErrorHandler.record_exception format, with the one-line message where it puts the
    # traceback: these errors are the user's to fix, and torchrun's summary prints that field.
    line = f"{type(err).__name__}: {err}"
    with open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                               "timestamp": str(int(time.time()))}}}, f)


# The C base of every file object (io.IOBase is the ABC above it), whose finalizer flushes at teardown.
_FILE_BASE = io.IOBase.__mro__[1]


def open_files(objects: list) -> list:
    """The file objects among `objects`: their type's MRO holds the C base, checked once per type.
    issubclass against the ABC costs about 0.4 ms for each type it has not seen, 0.4 s over the 1,300
    types of a rank with transformers loaded; type() rather than isinstance, which reads __class__."""
    files = {t for t in set(map(type, objects)) if _FILE_BASE in t.__mro__}
    return [obj for obj in objects if type(obj) in files]


def exit_now(code: int) -> None:
    """End this process as a normal exit does, less the interpreter's teardown: threads joined,
    atexit handlers run (logging, Ray, torch's own), every open file flushed, then os._exit. With
    torch and megatron loaded the teardown (freeing every module) takes about a second per process
    and writes nothing a run needs, so a launch of the quickstart ends that much sooner."""
    # The interpreter's own exit sequence, its private steps named: threading's exit hooks (they
    # stop idle ThreadPoolExecutor workers) then every non-daemon thread joined; then atexit.
    threading._shutdown()               # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for obj in open_files(gc.get_objects()):    # files left open: teardown would have flushed them
        try:
            if not obj.closed and obj.writable():
                obj.flush()
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)     # as sys.exit reads it
