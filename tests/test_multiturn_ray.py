"""Tool calls in Ray actors (multi_turn.tool_backend=ray) on a real local Ray: a hanging tool is
killed and its actor replaced, a tool that kills its process is contained, the rest run."""
import os
import textwrap
import time

import pytest

from megarl.rollout.multiturn.executor import ToolExecutor
from megarl.rollout.multiturn.parser import ToolCall
from megarl.rollout.multiturn.tools import load_tools

IMPLS = '''
import os, signal, time

def pid():
    return os.getpid()

def hang():
    time.sleep(3600)        # only killing the process ends it

def crash():
    os.kill(os.getpid(), signal.SIGKILL)     # the worker dies (os._exit is refused: it stops the run)
'''


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    yield ray
    ray.shutdown()


@pytest.mark.timeout(180)
def test_ray_backend_kills_hanging_tools(tmp_path, ray_cluster):
    (tmp_path / "impls.py").write_text(IMPLS)
    (tmp_path / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - {name: pid, implementation: impls.py:pid}
          - {name: hang, implementation: impls.py:hang, timeout_s: 1.0}
          - {name: crash, implementation: impls.py:crash}
          - {name: calculator, parameters: [{name: a, type: number}, {name: b, type: number}]}
        '''))
    ex = ToolExecutor(load_tools(str(tmp_path / "tools.yaml")), timeout_s=20.0, workers=2, backend="ray")
    start = time.perf_counter()
    res = ex.run([ToolCall("hang"), ToolCall("pid"), ToolCall("crash"), ToolCall("calculator", {"a": 1, "b": 2}),
                  ToolCall("pid")])
    took = time.perf_counter() - start
    assert [r.status for r in res] == ["timeout", "ok", "error", "ok", "ok"]
    assert res[0].text == "Error: tool 'hang' timed out after 1s" and "worker died" in res[2].text
    assert int(res[1].text) != os.getpid() and res[3].text == "3"     # tools ran in other processes
    assert ex.runner.replaced == 2 and took < 60
    # the pool is whole again: two calls run on two live actors
    assert [r.status for r in ex.run([ToolCall("pid"), ToolCall("pid")])] == ["ok", "ok"]
    ex.close()


@pytest.mark.timeout(180)
def test_ray_backend_kills_a_tool_holding_the_interpreter_lock_at_its_deadline(tmp_path, ray_cluster):
    """A catastrophic regular expression holds its actor's interpreter lock in C for hours; the
    rollout's process is another one, so the deadline is kept and the actor killed."""
    (tmp_path / "impls.py").write_text("import re\n\ndef backtrack(n):\n"
                                       "    return str(re.match(r'(a+)+$', 'a' * n + 'b'))\n")
    (tmp_path / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - {name: backtrack, parameters: [{name: n, type: integer}], implementation: impls.py:backtrack,
             timeout_s: 1.0}
        '''))
    ex = ToolExecutor(load_tools(str(tmp_path / "tools.yaml")), timeout_s=20.0, workers=1, backend="ray")
    assert ex.run([ToolCall("backtrack", {"n": 4})])[0].status == "ok"       # the actor is up
    start = time.perf_counter()
    res = ex.run([ToolCall("backtrack", {"n": 60})])
    took = time.perf_counter() - start
    assert res[0].status == "timeout" and took < 15 and ex.runner.replaced == 1
    ex.close()
