"""docs/extending.md's examples run as printed: each ```python block in one fresh interpreter (so
the names they register do not leak into other tests), in the page's order.

    python -m pytest -q tests/test_docs_extending.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = open(os.path.join(ROOT, "docs", "extending.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)
SECTIONS = re.findall(r"^## (.+)$", PAGE, re.M)


def test_the_page_has_one_example_per_extension():
    assert SECTIONS == ["A policy loss", "A rollout engine", "A weight-sync transport", "A model family",
                        "A model converter"]
    assert len(BLOCKS) == len(SECTIONS)


def test_every_example_runs_as_printed():
    program = "\n".join(f"# -- {title}\n{block}\nprint('ran:', {title!r})" for title, block in zip(SECTIONS, BLOCKS))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("ran:")] == [f"ran: {s}" for s in SECTIONS]
