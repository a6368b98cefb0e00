"""Running tool calls: checks first, then the implementations in parallel, each under a time limit.

    ex = ToolExecutor(tools, timeout_s=30, workers=8, backend="thread")
    results = ex.run(calls)        # one ToolResult(text, status) per call, in order; never raises

Every problem becomes text for the model and a status the loop counts: parse_error, unknown_tool,
no_implementation, bad_arguments, error (the tool raised), timeout, over_limit. One is not: a tool
that tries to end its process (os._exit, sys.exit) stops the run with UserCodeExit naming it, as a
reward that does so stops it (megarl/reward/scoring.py's exits_refused), never as a success.

backend=thread: one thread per running call, at most `workers` at once. Python cannot kill a
thread, so a call past its limit is abandoned (counted in `abandoned`) and keeps its thread until
it returns; later calls are not held up by it. A call that holds the interpreter lock in C stalls
the whole process until it returns, and is then reported as a timeout, never as ok.
backend=ray: a pool of `workers` Ray actors in other processes of the same user (isolation of
crashes and timeouts, not a security boundary: docs/security.md). An actor whose call passes its
limit is killed at the deadline and replaced, whatever the call holds; a result that reaches the
rollout after its limit is a timeout too.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from megarl.parallel.actor_pool import ActorPool, Job
from megarl.reward.scoring import RewardExit, exits_refused
from megarl.rollout.multiturn.parser import ToolCall
from megarl.rollout.multiturn.tools import Tool, load_implementation, tool_text

STATUSES = ("ok", "parse_error", "unknown_tool", "no_implementation", "bad_arguments", "error", "timeout",
            "over_limit")


class UserCodeExit(RuntimeError):
    """A tool or an interaction tried to end its process; the run stops with this one line, non-zero."""


@dataclass
class ToolResult:
    text: str
    status: str                            # one of STATUSES


class ToolExecutor:
    def __init__(self, tools: dict[str, Tool], timeout_s: float = 30.0, workers: int = 8, backend: str = "thread"):
        self.tools, self.timeout_s = tools, timeout_s
        if backend == "ray" and any(t.fn is not None for t in tools.values()):
            self.runner: _ThreadRunner | _RayRunner = _RayRunner(workers)
        elif backend in ("thread", "ray"):
            self.runner = _ThreadRunner(workers)
        else:
            raise ValueError(f"tool backend {backend!r}: use thread or ray")

    def check(self, call: ToolCall) -> ToolResult | None:
        """The result of a call that must not run, else None."""
        if call.error is not None:
            return ToolResult(f"Error: {call.error}", "parse_error")
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(self.tools) or "none"
            return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {names}", "unknown_tool")
        if tool.fn is None:
            return ToolResult(f"Error: tool {call.name!r} has no implementation configured", "no_implementation")
        why = tool.check(call.arguments)
        if why is not None:
            return ToolResult(f"Error: tool {call.name!r}: {why}", "bad_arguments")
        return None

    def run(self, calls: list[ToolCall], tools_kwargs: list | None = None) -> list[ToolResult]:
        """Results in order; `tools_kwargs[i]` is call i's row's extra_info.tools_kwargs (verl's)."""
        out: list[ToolResult | None] = [self.check(c) for c in calls]
        todo = [i for i, r in enumerate(out) if r is None]
        rows = tools_kwargs or [None] * len(calls)
        jobs = [(self.tools[calls[i].name], self.tools[calls[i].name].with_row(calls[i].arguments, rows[i]))
                for i in todo]
        for i, (status, value) in zip(todo, self.runner.run(jobs, self.timeout_s)):
            name = calls[i].name
            if status == "ok":
                out[i] = ToolResult(value, "ok")
            elif status == "exit":
                raise UserCodeExit(f"tool {name!r} ({self.tools[name].implementation}) {value} while running a "
                                   "call; a tool must return its output (or raise), not end the process")
            elif status == "timeout":
                limit = self.tools[name].timeout_s or self.timeout_s
                out[i] = ToolResult(f"Error: tool {name!r} timed out after {limit:g}s", "timeout")
            else:
                out[i] = ToolResult(f"Error: tool {name!r} failed: {value}", "error")
        return out  # type: ignore[return-value]

    @property
    def abandoned(self) -> int:
        return getattr(self.runner, "abandoned", 0)

    def close(self) -> None:
        self.runner.close()


def _call(fn, arguments: dict[str, Any]) -> tuple[str, str]:
    try:
        with exits_refused():     # os._exit/sys.exit here would end the rank, with exit code 0
            return "ok", tool_text(fn(**arguments))
    except RewardExit as err:
        return "exit", str(err)
    except BaseException as err:  # the user's tool: anything else it raises goes back to the model
        return "error", f"{type(err).__name__}: {err}"[:1000]


class _ThreadRunner:
    def __init__(self, workers: int):
        self.workers, self.abandoned = workers, 0

    def run(self, jobs: list[tuple[Tool, dict]], default_timeout: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str] | None] = [None] * len(jobs)
        done: queue.Queue = queue.Queue()      # this call's own: late results of abandoned calls go nowhere
        waiting, running = deque(range(len(jobs))), {}   # index -> deadline

        def target(i: int, tool: Tool, args: dict) -> None:
            res = _call(tool.fn, args)
            done.put((i, time.monotonic(), res))

        while waiting or running:
            while waiting and len(running) < self.workers:
                i = waiting.popleft()
                tool, args = jobs[i]
                # The deadline is set first: the new thread may hold the interpreter lock from its start.
                running[i] = time.monotonic() + (tool.timeout_s or default_timeout)
                threading.Thread(target=target, args=(i, tool, args), daemon=True, name=f"megarl-tool-{i}").start()
            try:
                i, finished, res = done.get(timeout=max(0.0, min(running.values()) - time.monotonic()))
                if i in running:
                    # A tool that holds the interpreter lock in C (a regex, a C extension) keeps this
                    # thread from checking its deadline until it returns: what it returns late is a
                    # timeout all the same, and its result is discarded.
                    out[i] = res if finished < running.pop(i) else ("timeout", "")
            except queue.Empty:
                pass
            now = time.monotonic()
            for i, deadline in list(running.items()):
                if now >= deadline:
                    del running[i]
                    out[i] = ("timeout", "")
                    self.abandoned += 1
        return out  # type: ignore[return-value]

    def close(self) -> None:
        pass


class _ToolActor:
    """A Ray actor that loads implementations by their spec (so user functions need not pickle)."""

    def __init__(self):
        self.fns: dict[str, Any] = {}

    def ready(self) -> bool:
        return True

    def call(self, spec: str, arguments: dict) -> tuple[str, str]:
        try:
            if spec not in self.fns:
                self.fns[spec] = load_implementation(spec, spec)
        except Exception as err:
            return "error", f"{type(err).__name__}: {err}"
        return _call(self.fns[spec], arguments)


class _RayRunner:
    """Tool calls on Ray actors (megarl/parallel/actor_pool.py): a call past its limit has its
    actor killed and replaced; a tool that kills its process is contained the same way."""

    def __init__(self, workers: int):
        self.pool = ActorPool(_ToolActor, workers)

    @property
    def replaced(self) -> int:
        return self.pool.replaced

    def run(self, jobs: list[tuple[Tool, dict]], default_timeout: float) -> list[tuple[str, str]]:
        limits = [tool.timeout_s or default_timeout for tool, _ in jobs]
        done = self.pool.run([Job("call", (tool.implementation, args), limit)
                              for (tool, args), limit in zip(jobs, limits)])
        return [("timeout", "") if d.timed_out or d.seconds > limit else
                ("error", f"the tool's worker died: {d.died}") if d.died is not None else d.value
                for d, limit in zip(done, limits)]

    def close(self) -> None:
        self.pool.close()
