"""Run a few lines of Python in a fresh interpreter and return what they print: for checks of what
an import or a config load pulls in, which only a new process can see."""
from __future__ import annotations

import subprocess
import sys


def prints(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()
