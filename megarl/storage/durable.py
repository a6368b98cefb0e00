"""Private directories and durable writes (no torch: the launcher and the preflight use them).

    make_private_dir(run_dir)             # created 0700; an existing directory keeps its mode
    write_durably(path, text)             # temp file 0600, fsync, rename, fsync of the directory
    fsync_dir(path)                       # after a rename into `path`
"""
from __future__ import annotations

import os


def make_private_dir(path: str) -> str:
    """Create `path` (and parents) with the new leaf mode 0700. An existing directory keeps its mode."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)           # makedirs' mode is masked by the umask; 0700 is the intent
    return path


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file: fsync, rename, fsync of the directory."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
