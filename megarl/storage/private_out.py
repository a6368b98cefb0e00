"""Files megarl writes outside its private run directory: generation dumps (trainer.rollout_data_dir,
trainer.validation_data_dir), and a trainer.log_dir's val_generations.jsonl and TensorBoard events.

Such a directory may sit in a shared place (/tmp, a group scratch). Another user who can write there
could plant a link at the name megarl is about to write, turning the write into an overwrite of any
file the run's owner can write. So each directory is held to the run directory's rule (this user's,
writable by no one else), new files are made under a random private name that is never a link
(mkstemp: O_CREAT | O_EXCL | O_NOFOLLOW, 0600) and renamed into place, and appends refuse a link.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import TextIO

from megarl.config.errors import ConfigError
from megarl.storage.durable import make_private_dir


def check_output_dir(path: str, key: str) -> str:
    """Create `path` (mode 0700) if missing; then require a directory of this user's that no one else
    can write, as a resume requires of the run directory. A link is followed only where this user
    made it. Returns `path`; a violation is one ConfigError line naming `key`."""
    where = os.path.abspath(path)
    own = os.geteuid()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):     # made below, or said why not
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != own:
            raise ConfigError(f"{where} is a symbolic link made by uid {link.st_uid}, not by this user; megarl "
                              "does not write through it; choose a directory of your own", key)
    try:
        make_private_dir(path)
        st = os.stat(path)
    except OSError as err:
        raise ConfigError(f"cannot create {where} ({err.strerror}); choose a writable directory", key) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where} is not a directory; choose a directory of your own", key)
    if st.st_uid != own:
        raise ConfigError(f"{where} is owned by uid {st.st_uid}, not by this user, so another user could plant "
                          "links in it; choose a directory of your own", key)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = " and ".join(name for bit, name in ((0o020, "group"), (0o002, "others")) if mode & bit)
        raise ConfigError(f"{where} is writable by {who} (mode {mode:o}), so "
                          f"another user could plant links in it; chmod 700 {where} (or choose a new directory)", key)
    return path


@contextlib.contextmanager
def new_file(directory: str, name: str) -> Iterator[TextIO]:
    """A text file that becomes `directory`/`name` when the block ends without error: written under a
    random private name, then renamed over `name` (a link at `name` is replaced, never followed). A
    reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_append(path: str, key: str) -> TextIO:
    """`path` opened to append text, created 0600 if missing; a link at `path`, or a file that is not a
    plain file of this user's with one name, is refused in one ConfigError line naming `key`."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        why = "is a symbolic link" if os.path.islink(path) else f"cannot be opened ({err.strerror})"
        raise ConfigError(f"{os.path.abspath(path)} {why}; megarl appends only to a plain file of its own; "
                          "remove it or choose another directory", key) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise ConfigError(f"{os.path.abspath(path)} is not a plain file of this user's with one name (uid "
                          f"{st.st_uid}, {st.st_nlink} links); remove it or choose another directory", key)
    return os.fdopen(fd, "a", encoding="utf-8")
