"""A tool or an interaction that ends its process (os._exit(0), sys.exit) cannot end a run as a
success: the run stops non-zero with one line naming it, as a reward that does so stops it
(tests/faults/test_reward_faults.py).

    python -m pytest -q tests/faults/test_tool_exits.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.checkout import ROOT

EXITS = textwrap.dedent("""
    import os, sys

    def add(a, b):
        os._exit(0)

    def leave(a, b):
        sys.exit(0)

    def add_ok(a, b):
        return a + b

    def user(text, sample=None, turn=0):
        os._exit(0)
""")


def in_child(code: str, tmp_path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: where the guard is missing, os._exit(0) ends it, not pytest."""
    (tmp_path / "exits.py").write_text(EXITS)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})


TOOL = """
    from megarl.rollout.multiturn.executor import ToolExecutor, UserCodeExit
    from megarl.rollout.multiturn.parser import ToolCall
    from megarl.rollout.multiturn.tools import Tool, load_implementation
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
              "required": ["a", "b"]}
    def executor(name, backend="thread"):
        fn = load_implementation(f"exits.py:{name}", "t")
        tool = Tool("calculator", "", schema, implementation=f"exits.py:{name}", fn=fn)
        return ToolExecutor({"calculator": tool}, timeout_s=5.0, workers=2, backend=backend)
    [ok] = executor("add_ok").run([ToolCall("calculator", {"a": 1, "b": 2}, None)])
    assert ok.status == "ok" and ok.text == "3", ok                        # the control
    for name in ("add", "leave"):
        try:
            executor(name).run([ToolCall("calculator", {"a": 1, "b": 2}, None)])
        except UserCodeExit as err:
            print("STOPPED", err)
        else:
            print("RETURNED")
"""


def test_a_tool_that_exits_stops_the_call_naming_it(tmp_path):
    out = in_child(TOOL, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr[-2000:]      # an unguarded os._exit(0) ends with nothing
    assert lines[0] == ("STOPPED tool 'calculator' (exits.py:add) called os._exit(0) while running a call; a tool "
                        "must return its output (or raise), not end the process"), lines
    assert lines[1].startswith("STOPPED tool 'calculator' (exits.py:leave) called sys.exit(0)"), lines


def test_an_interaction_that_exits_stops_the_turn_naming_it(tmp_path):
    out = in_child("""
        from types import SimpleNamespace
        from megarl.rollout.multiturn.loop import _ask
        from megarl.rollout.multiturn.executor import UserCodeExit
        from exits import user
        try:
            _ask(user, "A: 3", SimpleNamespace(sample={}, turns=1))
        except UserCodeExit as err:
            print("STOPPED", err)
        else:
            print("RETURNED")
    """, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("STOPPED interaction exits.user called os._exit(0) while "
                                                         "replying"), out.stdout + out.stderr[-2000:]


TOOLS_YAML = """
tools:
  - name: "calculator"
    description: "Add two numbers together"
    parameters:
      - {name: "a", type: "number", description: "First number"}
      - {name: "b", type: "number", description: "Second number"}
    implementation: "exits.py:add"
"""


@pytest.mark.timeout(900)
def test_a_run_whose_tool_exits_fails_in_one_line(tmp_path):
    """configs/tool_use.yaml, its calculator replaced by one that calls os._exit(0): the run exits
    non-zero with one line naming the tool, never as a success at the first call."""
    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "tools.yaml").write_text(TOOLS_YAML)
    model = tmp_path / "model"
    args = ["--config", os.path.join(ROOT, "configs", "tool_use.yaml"),
            "actor_rollout_ref.model.bootstrap=megarl.examples.tool_use:bootstrap",
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={model / 'tokenizer'}",
            f"actor_rollout_ref.rollout.tools={tmp_path / 'tools.yaml'}",
            "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, "-m", "megarl.train", *args], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=840, env={**os.environ, "PYTHONPATH": ROOT})
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("megarl: stopped:")]
    assert len(stopped) == 1, text[-3000:]
    assert f"tool 'calculator' ({tmp_path / 'exits.py'}:add) called os._exit(0) while running a call" in stopped[0], \
        stopped
