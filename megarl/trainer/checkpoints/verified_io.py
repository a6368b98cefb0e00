"""The one way megarl writes and reads back step checkpoints: private, owned, listed in a
SHA-256 manifest, and read without running code.

    make_private_dir / write_durably / fsync_dir     # megarl.storage.durable: 0700 directories, fsync then rename
    save_plain(obj, path) / load_plain(path)        # megarl.storage.plain_state: data only, weights-only unpickler
    seal(step_dir)                                  # collective: 0600/0700, fsync, write manifest.json
    verify(step_dir)                                # collective: refuse the step before anything is read
    load_sealed(step_dir, "trainer_state.pt")       # megarl's own files: hashed and loaded from one read

Megatron's distributed checkpoints hold a pickled `.metadata` and pickled byte items that torch's
reader unpickles; they cannot be read any other way. So a resume first checks every file of the
step: a regular file (no symlink), owned by this user, not writable by group or others, listed
in the manifest with the same digest, and no file the manifest does not list. Only then does
anything load. Each rank hashes its share of the files (`files[rank::world]`), so the cost of a
large checkpoint is spread (about 1 GB/s per core with OpenSSL's SHA-256).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat

import torch.distributed as dist

from megarl.storage.durable import fsync_dir, make_private_dir, write_durably  # noqa: F401  (used by checkpointing)
from megarl.storage.plain_state import load_plain, save_plain  # noqa: F401  (the one reader of step files)

MANIFEST = "manifest.json"
FORMAT = "megarl-manifest-1"
_CHUNK = 1 << 22


class Refused(Exception):
    """A step checkpoint that must not be read; the text is one line naming the file."""


# -- the manifest ---------------------------------------------------------------------------------------
def _files(top: str) -> list[str]:
    """Every entry under `top` as a relative path, sorted (the same list on every rank)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        rel = os.path.relpath(dirpath, top)
        out += [os.path.normpath(os.path.join(rel, n)) for n in sorted(filenames)]
        out += [os.path.normpath(os.path.join(rel, n)) for n in dirnames if os.path.islink(os.path.join(dirpath, n))]
    return sorted(n for n in out if n != MANIFEST)


def _digest(path: str, sync: bool = False) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(fd)        # megatron's writers close without fsync: make the bytes durable here
    finally:
        os.close(fd)
    return h.hexdigest()


def rank_world(group) -> tuple[int, int]:
    """This rank's share of the files: over `group` (the default group when None), else alone."""
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def gather(obj, group) -> list:
    rank, world = rank_world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


class SealError(OSError):
    """A rank's part of seal() failed; raised on every rank, naming that rank (`failed_rank`)."""

    def __init__(self, errno_: int | None, strerror: str, filename: str | None, failed_rank: int):
        super().__init__(errno_, strerror, filename)
        self.failed_rank = failed_rank


def seal(step_dir: str, group=None) -> None:
    """Collective, after every rank wrote its files: files 0600 and directories 0700, each file
    fsynced and hashed by one rank, then rank 0 writes manifest.json (durably). A rank whose
    share fails still reaches the gather, so every rank raises the same SealError."""
    rank, world = rank_world(group)
    files = _files(step_dir)
    mine = {}
    try:
        for rel in files[rank::world]:
            path = os.path.join(step_dir, rel)
            os.chmod(path, 0o600)
            mine[rel] = (_digest(path, sync=True), os.path.getsize(path))
    except OSError as err:
        mine = {"": (err.errno, err.strerror or str(err), err.filename)}
    parts = gather(mine, group)
    for r, part in enumerate(parts):
        if "" in part:
            raise SealError(*part[""], failed_rank=r)
    got = {k: v for part in parts for k, v in part.items()}
    digests, sizes = {k: v[0] for k, v in got.items()}, {k: v[1] for k, v in got.items()}
    if rank == 0:
        for dirpath, _, _ in os.walk(step_dir):
            os.chmod(dirpath, 0o700)
        write_durably(os.path.join(step_dir, MANIFEST),
                      json.dumps({"format": FORMAT, "sha256": digests, "bytes": sizes}, indent=0))
        for dirpath, _, _ in os.walk(step_dir, topdown=False):
            fsync_dir(dirpath)


def check_owner(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _problems(step_dir: str, read: str, rank: int, world: int, listed_out: dict) -> tuple[str, str] | None:
    """(file, problem) for the first thing wrong with `step_dir` (read through the path `read`), or
    None; the manifest's digests go into `listed_out`."""
    root = os.path.dirname(step_dir)
    if os.path.islink(step_dir):        # its files would be checked wherever it points
        return f"({step_dir})", f"is a symbolic link (to {os.path.realpath(step_dir)}); a step directory is read " \
                                "only where it was saved"
    for path, what, shown in ((root, "the run directory ", root), (read, "", step_dir)):
        bad = check_owner(os.stat(path))
        if bad:
            return f"({what}{shown})", bad
    step_dir = read
    manifest_path = os.path.join(step_dir, MANIFEST)
    if not os.path.lexists(manifest_path):
        return MANIFEST, "is missing (saved by an older megarl, or not by megarl)"
    for dirpath, dirnames, filenames in os.walk(step_dir):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, step_dir)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                return rel, "is a symbolic link"
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                return rel, "is not a regular file"
            bad = check_owner(st)
            if bad:
                return rel, bad
    try:
        with open(manifest_path) as f:
            listed = json.load(f)
        if not isinstance(listed, dict) or listed.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        sizes, listed = listed.get("bytes", {}), listed.get("sha256")
        # A hand-edited manifest of the wrong types is refused here, not met as a TypeError below.
        if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
            raise ValueError("'sha256' is not a map of file names to hex digests")
        if not isinstance(sizes, dict) or not all(type(v) is int for v in sizes.values()):
            raise ValueError("'bytes' is not a map of file names to integer sizes")
    except (OSError, ValueError, AttributeError) as err:
        return MANIFEST, f"cannot be read ({type(err).__name__}: {str(err)[:120]})"
    files = _files(step_dir)
    for rel in files:
        if rel not in listed:
            return rel, "is not in the manifest (added after the save)"
    for rel in sorted(listed):
        if rel not in files:
            return rel, "is listed in the manifest but missing"
    for rel in files:                     # sizes first: cheap, and a short file reads as truncated
        size = os.path.getsize(os.path.join(step_dir, rel))
        if rel in sizes and size != sizes[rel]:
            return rel, (f"is truncated ({size} of {sizes[rel]} bytes)" if size < sizes[rel] else
                         f"has {size} bytes, not the {sizes[rel]} saved")
    for rel in files[rank::world]:
        if _digest(os.path.join(step_dir, rel)) != listed[rel]:
            return rel, "differs from the SHA-256 digest in the manifest (changed after the save)"
    listed_out.update(listed)
    return None


def verify(step_dir: str, group=None, through: str | None = None) -> dict[str, str]:
    """Collective: raise Refused (the same one line on every rank) unless the whole step checks out.
    Returns the digests checked (relative path -> SHA-256). `through`: the path this rank reads the
    step by (staging.checked_step's held-open directory); messages still name `step_dir`."""
    step_dir = os.path.abspath(step_dir)
    rank, world = rank_world(group)
    listed: dict[str, str] = {}
    try:
        mine = _problems(step_dir, through or step_dir, rank, world, listed)
    except OSError as err:
        mine = (os.path.basename(err.filename or step_dir), f"cannot be checked ({err.strerror})")
    found = [p for p in gather(mine, group) if p is not None]
    if found:
        rel, problem = min(found)
        raise Refused(f"{rel} {problem}")
    return listed


def load_sealed(step_dir: str, rel: str):
    """A megarl file (load_plain's format) of a step verify() accepted, read once through one descriptor
    (no symlink followed), hashed, and loaded from those same bytes: nothing can swap the file between
    its check and its load. Megatron's own files are read by torch's checkpoint reader, by path:
    staging.checked_step holds the step directory open so that path names the bytes verify() checked."""
    manifest, data = (_read_owned(os.path.join(step_dir, name), name) for name in (MANIFEST, rel))
    digest = (json.loads(manifest).get("sha256") or {}).get(rel)
    if digest is None or hashlib.sha256(data).hexdigest() != digest:
        raise Refused(f"{rel} differs from the SHA-256 digest in the manifest (changed after the step was checked)")
    return load_plain(io.BytesIO(data))


def _read_owned(path: str, rel: str) -> bytes:
    """The bytes of a regular file of this user's that no one else may write, read through one
    descriptor (no link followed): a step directory moved away and replaced by another user's after
    verify() cannot hand over their manifest and file together."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        bad = None if stat.S_ISREG(st.st_mode) else "is not a regular file"
        if bad or (bad := check_owner(st)):
            raise Refused(f"{rel} {bad} (changed after the step was checked)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)
