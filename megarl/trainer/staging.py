"""Where megatron's checkpoint files of a verified step are loaded from: in place, or a private copy.

    with staging.megatron_source(step_dir, digests, ["actor"], say) as src:   # collective
        worker.load_checkpoint(os.path.join(src, "actor"))

torch's checkpoint reader opens `.metadata` (a pickle) and the `.distcp` files by path, after
verified_io.verify() hashed them. Anyone who can change what those paths name in between could
have torch read bytes nobody checked. Inside the run directory only this user can (verify refuses
anything group- or world-writable or owned by someone else); above it, a directory another user
owns or may write (without the sticky bit guarding our entry) lets them rename the run directory
away and put their own in its place. So: when no directory on the way to the run directory is open
to others, megatron loads in place (no cost; a process running as you could rewrite the manifest
too, docs/security.md). Otherwise the step's role files are copied into a fresh 0700 directory,
each read once through one descriptor and hashed as it is copied against the digests verify()
checked, and megatron loads the copy; one copy per node, the node's ranks sharing the files.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import stat
import tempfile

import torch.distributed as dist

from megarl.trainer.verified_io import Refused, gather, rank_world, check_owner

_CHUNK = 1 << 22


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


def copy_checked(src: str, dst: str, rel: str, digest: str) -> int:
    """Copy `src` to a new 0600 `dst`, read once through one descriptor (no link followed, a regular
    file of this user's that others cannot write) and hashed as it is copied; Refused unless the
    bytes are those verify() checked. Returns the size."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        bad = None if stat.S_ISREG(st.st_mode) else "is not a regular file"
        if bad or (bad := check_owner(st)):
            raise Refused(f"{rel} {bad} (changed after the step was checked)")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        h, size = hashlib.sha256(), 0
        try:
            while chunk := os.read(fd, _CHUNK):
                h.update(chunk)
                size += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
        finally:
            os.close(out)
    finally:
        os.close(fd)
    if h.hexdigest() != digest:
        raise Refused(f"{rel} differs from the SHA-256 digest in the manifest (changed after the step was checked)")
    return size


@contextlib.contextmanager
def megatron_source(step_dir: str, digests: dict[str, str], roles: list[str], say=None):
    """Collective. Yields the directory to load `roles`' megatron files from: the step itself when
    only this user can change the path to it, else a checked private copy (removed on exit).
    `say` (rank 0's log, or None) gets one line saying which and why."""
    run_dir = os.path.realpath(os.path.dirname(os.path.abspath(step_dir)))
    real = os.path.join(run_dir, os.path.basename(os.path.normpath(step_dir)))
    name = os.path.basename(real)
    rank, world = rank_world(None)
    # every rank takes the same branch (the next steps are collective): a copy if any node sees a risk
    why = next((w for w in gather(open_to_others(run_dir), None) if w), None)
    if why is None:
        if say:
            say(f"megarl: loading {name}'s megatron files in place: only you can change them and the path to them")
        yield real
        return
    hosts = gather(socket.gethostname(), None)
    mates = [r for r, h in enumerate(hosts) if h == hosts[rank]]     # the ranks of this node share a copy
    leader = mates[0]
    made = tempfile.mkdtemp(prefix=f"megarl-load-{name}-") if rank == leader else None
    stage = gather(made, None)[leader]
    files = sorted(rel for rel in digests if rel.split("/", 1)[0] in roles)
    problem, copied = None, 0
    try:
        if rank == leader and (unsafe := open_to_others(os.path.realpath(stage))):
            raise Refused(f"its private copy cannot be made: {unsafe}; set TMPDIR to a directory only you can write")
        for rel in files[mates.index(rank)::len(mates)]:
            dst = os.path.join(stage, rel)
            os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
            copied += copy_checked(os.path.join(real, rel), dst, rel, digests[rel])
    except Refused as err:
        problem = str(err)
    except OSError as err:
        problem = f"its private copy in {stage} failed: {err.strerror or err}; free space there or set TMPDIR"
    found = gather((problem, copied), None)
    try:
        bad = sorted(p for p, _ in found if p)
        if bad:
            raise Refused(bad[0])
        if say:
            size = sum(c for _, c in found)
            say(f"megarl: {why}, so another user could swap {name}'s files after their check: megatron loads a "
                f"private copy ({size / 1e6:.1f} MB in {len(files)} files, hashed as they were copied) from {stage}")
        yield stage
    finally:
        if world > 1:
            dist.barrier()          # every rank of the node is done reading the copy
        if rank == leader:
            shutil.rmtree(stage, ignore_errors=True)
