"""Tool calls in model text, hermes format (Qwen2.5/Qwen3, NousResearch Hermes and most open models):

    <tool_call>{"name": "calculator", "arguments": {"a": 3, "b": 4}}</tool_call>

    calls = parse_tool_calls(text)           # every complete call in order, and an unclosed one last
    end = end_of_call(text, k)               # where the k-th complete call ends (None if fewer)

A call that cannot be used (invalid JSON, no name, arguments that are not an object, an opening
tag never closed) comes back with `error` set: the loop answers it with that text instead of
running anything, so the model learns the format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None                # why the call is unusable (sent back to the model)


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(OPEN)
        stop = text.find(CLOSE, body_start)
        nested = text.find(OPEN, body_start)
        if stop < 0 or (0 <= nested < stop):
            # Never closed (or a second call opened first): report once, keep parsing after it.
            calls.append(ToolCall(None, error=f"{OPEN} was not closed with {CLOSE}"))
            if stop < 0:
                return calls
            pos = nested
            continue
        calls.append(_decode(text[body_start:stop]))
        pos = stop + len(CLOSE)


# json.loads raises RecursionError on about a thousand nested brackets; model text must never end a
# run, so that is a malformed call like any other.
_TOO_DEEP = ('the tool call nests too deeply to parse (over a thousand brackets); write '
             '{"name": ..., "arguments": {...}}')


def _decode(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(None, error=f"the tool call is not valid JSON ({err.msg} at character {err.pos}); write "
                                    '{"name": ..., "arguments": {...}}')
    except RecursionError:
        return ToolCall(None, error=_TOO_DEEP)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='the tool call must be a JSON object with a "name" string and an "arguments" '
                                    "object")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):               # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
        except RecursionError:
            return ToolCall(obj["name"], error=_TOO_DEEP)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(obj["name"], args)


def end_of_call(text: str, k: int) -> int | None:
    """The character index just past the k-th (1-based) complete call's closing tag, else None."""
    pos, found = 0, 0
    while found < k:
        start = text.find(OPEN, pos)
        if start < 0:
            return None
        stop = text.find(CLOSE, start + len(OPEN))
        if stop < 0:
            return None
        pos = stop + len(CLOSE)
        found += 1
    return pos
