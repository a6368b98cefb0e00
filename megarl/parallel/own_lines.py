"""megarl's own status lines from a rank, told apart from everything else the rank prints.

    own_line(f"megarl: config error: {err}")      # recorded, then printed on stderr

megarl-train's launcher (megarl/train.py) gives its ranks a private file (RECORDS_ENV); a rank
appends each status line there before printing it, and the launcher's console copy
(megarl/launcher/output.py) acts only on lines it finds in that file. A data row or a reward that
prints the same words cannot put them there: the path leaves the environment as the rank starts.
"""
from __future__ import annotations

import os
import sys

RECORDS_ENV = "MEGARL_OWN_LINES"
_records = os.environ.pop(RECORDS_ENV, None)     # code the rank runs later (a reward, a tool) lacks it


def own_line(text: str) -> None:
    """Print one of megarl's status lines (stderr), recorded first for the launcher."""
    if _records:
        try:
            fd = os.open(_records, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, text.encode(errors="replace") + b"\n")     # one append: ranks do not interleave
            finally:
                os.close(fd)
        except OSError:                  # the launcher is gone or the disk is full: the line still prints
            pass
    # One write of line and newline: two ranks that stop at once share one stderr pipe, and print()'s
    # separate writes of text and end would splice their lines into one the launcher cannot match
    # (a pipe write up to PIPE_BUF bytes is atomic).
    data = (text + "\n").encode(errors="replace")
    try:
        sys.stderr.flush()
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):     # a replaced stderr (pytest's capture): print to it
        print(text, file=sys.stderr, flush=True)
        return
    while data:
        data = data[os.write(fd, data):]
