"""A tool that holds the interpreter lock in C past its timeout (a catastrophic regular expression:
`re` never releases the lock while it matches) is reported as "timeout", its result discarded; on
tool_backend=ray its actor is killed at the deadline (tests/test_multiturn_ray.py).

    python -m pytest -q tests/faults/test_tool_gil_timeout.py
"""
from __future__ import annotations

import textwrap
import time

from megarl.rollout.multiturn.executor import ToolExecutor
from megarl.rollout.multiturn.parser import ToolCall
from megarl.rollout.multiturn.tools import load_tools

IMPLS = '''
import re
import time

def backtrack(n):
    start = time.monotonic()
    re.match(r"(a+)+$", "a" * n + "b")      # exponential backtracking, all of it inside the C matcher
    return f"matched in {time.monotonic() - start:.2f}s"

def quick(x):
    return f"quick {x}"
'''
TOOLS = '''
tools:
  - {name: backtrack, parameters: [{name: n, type: integer}], implementation: impls.py:backtrack, timeout_s: 0.2}
  - {name: quick, parameters: [{name: x, type: integer}], implementation: impls.py:quick}
'''


def _executor(tmp_path) -> ToolExecutor:
    (tmp_path / "impls.py").write_text(IMPLS)
    (tmp_path / "tools.yaml").write_text(textwrap.dedent(TOOLS))
    return ToolExecutor(load_tools(str(tmp_path / "tools.yaml")), timeout_s=5.0, workers=2, backend="thread")


def _n_for(seconds: float) -> int:
    """The string length whose match takes about `seconds` here (each extra 'a' doubles the work)."""
    import re
    n = 16
    while True:
        start = time.monotonic()
        re.match(r"(a+)+$", "a" * n + "b")
        if time.monotonic() - start > seconds / 4:
            return n + 2
        n += 1


def test_a_call_holding_the_interpreter_lock_past_its_limit_is_a_timeout_not_ok(tmp_path):
    ex = _executor(tmp_path)
    n = _n_for(1.0)
    start = time.monotonic()
    res = ex.run([ToolCall("backtrack", {"n": n}), ToolCall("quick", {"x": 1})])
    took = time.monotonic() - start
    assert took > 0.5               # the lock was held: the limit could not be enforced while it was
    assert [r.status for r in res] == ["timeout", "ok"], [r.text for r in res]
    assert res[0].text == "Error: tool 'backtrack' timed out after 0.2s" and res[1].text == "quick 1"
    assert "matched" not in res[0].text


def test_a_call_inside_its_limit_is_still_ok(tmp_path):
    ex = _executor(tmp_path)
    res = ex.run([ToolCall("backtrack", {"n": 8})])
    assert res[0].status == "ok" and res[0].text.startswith("matched in")
