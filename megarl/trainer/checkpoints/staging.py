"""Where a resume and an export read a step checkpoint from: the step directory itself, held open.

    with staging.checked_step(step_dir, ["actor"], say) as src:      # collective: verify, then load
        worker.load_checkpoint(os.path.join(src, "actor"))

torch's checkpoint reader opens `.metadata` (a pickle) and the `.distcp` files by path. Whoever may
rename an entry in a directory above the run directory (a group-writable project directory, without
the sticky bit guarding our entry) could move the step away between its check and that read and put
their own in its place. So the step directory is opened once (no link followed), and verify() and
megatron both read it through /proc/<pid>/fd/<n>, a name of that open directory that no rename above
it changes. The directory and all below it are this user's and writable by no one else (verify()
checks them through it), so only this user can change what it holds: megatron reads the bytes that
were hashed, with no copy, no temporary space and no second read, wherever the run directory lives.
"""
from __future__ import annotations

import contextlib
import os
import stat

from megarl.trainer.checkpoints.verified_io import Refused, gather, verify


def open_to_others(path: str) -> str | None:
    """Why a user other than this one (or root) could change what the absolute, symlink-free `path`
    names, or None: a directory on the way down that another user owns, or that group or others
    may write while the sticky bit does not keep them off our entry in it."""
    me = os.geteuid()
    here = os.sep
    for name in [p for p in path.split(os.sep) if p]:
        st, below = os.stat(here), os.path.join(here, name)
        entry = os.lstat(below)
        if st.st_uid not in (me, 0):
            return f"{here} is owned by uid {st.st_uid}"
        guarded = st.st_mode & stat.S_ISVTX and entry.st_uid in (me, 0)
        if st.st_mode & 0o022 and not guarded:
            who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
            return f"{here} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
        if stat.S_ISLNK(entry.st_mode):        # only when the caller did not resolve links
            return f"{below} is a symbolic link"
        here = below
    return None


def _hold(real: str) -> tuple[int | None, str | None]:
    """(descriptor, problem): the directory `real` opened without following a link, and checked
    reachable as /proc/<pid>/fd/<n> (the name every later read goes through)."""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        return None, f"({real}) cannot be opened ({err.strerror})"
    try:
        if os.path.samestat(os.stat(held_path(fd)), os.fstat(fd)):
            return fd, None
    except OSError:
        pass
    os.close(fd)
    return None, (f"({real}) cannot be held open as /proc/{os.getpid()}/fd/{fd} (is /proc mounted?); megarl reads "
                  "a step only through the directory it checked")


def held_path(fd: int) -> str:
    # the pid, not "self": a helper process the reader forks resolves the same directory
    return f"/proc/{os.getpid()}/fd/{fd}"


@contextlib.contextmanager
def checked_step(step_dir: str, roles: list[str], say=None, group=None):
    """Collective. Yields (the path to read the step by, the digests verify() checked) once every
    rank has opened the same step directory and verify() accepted the whole step through it;
    raises Refused (one line, the same on every rank) otherwise. `say` (rank 0's log, or None) gets
    one line saying where the step is read from and why it is safe."""
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(step_dir))),
                        os.path.basename(os.path.normpath(step_dir)))
    fd, problem = _hold(real) if not os.path.islink(real) else (None, None)   # verify() names a link
    try:
        through = held_path(fd) if fd is not None else None
        digests = verify(real, group, through=through)
        # every rank must read the directory every other rank checked its share of
        seen = gather((problem, os.fstat(fd).st_ino if fd is not None else None), group)
        bad = sorted(p for p, _ in seen if p)
        if bad:
            raise Refused(bad[0])
        if len({ino for _, ino in seen}) != 1:
            raise Refused(f"({real}) was replaced by another directory while the ranks opened it; whoever may "
                          "write above it moved it: keep the run directory where only you can rename it")
        if say:
            why = open_to_others(os.path.dirname(real))
            guard = (f"{why}, but the step is read only through the directory checked, held open" if why else
                     "only you can change it and the path to it")
            rel = sorted(r for r in digests if r.split("/", 1)[0] in roles)
            size = sum(os.path.getsize(os.path.join(through or real, r)) for r in rel)
            say(f"megarl: loading {os.path.basename(real)} ({', '.join(roles)}: {size / 1e6:.1f} MB in {len(rel)} "
                f"files, each hashed) in place: {guard}")
        yield through or real, digests
    finally:
        if fd is not None:
            os.close(fd)
