"""Tools of multi-turn rollouts: tools.yaml -> Tool objects with a schema, an argument check and
(where one is configured) an implementation.

    tools = load_tools("tools.yaml")      # {name: Tool}; a bad file is one ConfigError line
    tools["calculator"].schema            # OpenAI function schema (what chat templates render)
    tools["calculator"].check(args)       # None, or the error text the model gets back

tools.yaml, in the form of verl's rollout guide (verl's `tool_schema:` entries and OpenAI's `{type: function,
function: {...}}` entries load too):

    tools:
      - name: calculator
        description: Add two numbers together
        parameters:                       # a list of {name, type, description[, required, enum]}
          - {name: a, type: number, description: First number}
          - {name: b, type: number, description: Second number}
        implementation: builtin:calculator  # optional: pkg.module:function or path/file.py:function
        timeout_s: 5                        # optional: overrides multi_turn.tool_timeout_s

An implementation is called as `fn(**arguments)` with the model's JSON arguments (checked against
the parameters first) and returns str | dict | list | number; anything but a string reaches the
model as JSON. verl's per-row `extra_info.tools_kwargs` ({tool name: {create_kwargs: {...},
execute_kwargs: {...}}}, e.g. the ground truth verl's Gsm8kTool is created with) reaches a function
that names `create_kwargs` and/or `execute_kwargs` among its keyword parameters, as those dicts
({} when the row gives none), the way verl hands them to a tool's create and execute:

    def check_answer(answer: str, *, create_kwargs: dict) -> str:
        return "correct" if answer == create_kwargs.get("ground_truth") else "try again"

Relative file paths resolve against the tools.yaml's folder, then the working directory. A tool
without an implementation (the guide's `search`: there is no internet here) loads with a warning,
and calling it tells the model so.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from megarl.config.errors import ConfigError
from megarl.config.loader import load_yaml_text
from megarl.config.plugins import get_attr, import_path
from megarl.rollout.multiturn import builtins

log = logging.getLogger("megarl.rollout.multiturn")
TOOLS_KEY = "actor_rollout_ref.rollout.tools"
JSON_TYPES = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,), "array": (list,),
              "object": (dict,), "null": (type(None),)}
TYPE_ALIASES = {"str": "string", "float": "number", "int": "integer", "bool": "boolean", "list": "array",
                "dict": "object", "none": "null"}
ROW_KWARGS = ("create_kwargs", "execute_kwargs")   # verl's per-row tools_kwargs, by the tool call they reach
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]                 # JSON schema of the arguments object
    implementation: str | None = None          # resolved spec: builtin:x, /abs/file.py:fn, pkg.mod:fn
    fn: Callable[..., Any] | None = field(default=None, repr=False)
    timeout_s: float | None = None
    row_kwargs: tuple[str, ...] = ()           # which of ROW_KWARGS fn takes (verl's tools_kwargs parts)

    def with_row(self, arguments: dict[str, Any], tools_kwargs: Any) -> dict[str, Any]:
        """The call's keyword arguments: the model's, plus this tool's part of the row's tools_kwargs."""
        mine = tools_kwargs.get(self.name) if isinstance(tools_kwargs, dict) else None
        mine = mine if isinstance(mine, dict) else {}
        return {**arguments, **{k: dict(mine.get(k) or {}) for k in self.row_kwargs}}

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check(self, arguments: dict[str, Any]) -> str | None:
        """Why these arguments do not fit the parameters (the text the model gets back), or None."""
        props = self.parameters.get("properties") or {}
        missing = [p for p in self.parameters.get("required") or [] if p not in arguments]
        if missing:
            return f"missing required argument{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
        if self.parameters.get("additionalProperties") is not True:
            extra = [a for a in arguments if a not in props]
            if extra:
                return (f"unexpected argument {extra[0]!r}; parameters: "
                        + (", ".join(props) or "none"))
        for arg, value in arguments.items():
            spec = props.get(arg) or {}
            kind = spec.get("type")
            if kind in JSON_TYPES and not _is_type(value, kind):
                return f"argument {arg!r} must be {_article(kind)}, got {type(value).__name__} {value!r}"[:300]
            if "enum" in spec and value not in spec["enum"]:
                return f"argument {arg!r} must be one of {spec['enum']}, got {value!r}"[:300]
        return None


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("number", "integer"):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, JSON_TYPES[kind])


def _article(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def load_tools(path: str, key: str = TOOLS_KEY) -> dict[str, Tool]:
    """Read and check a tools.yaml; implementations are imported now, so a bad one stops the run here."""


    if not os.path.isfile(path):
        raise ConfigError(f"tools file {path} does not exist; give the path of a tools.yaml", key)
    try:
        with open(path) as f:
            raw = load_yaml_text(f, path)  # a repeated key is an error, not "last one wins"
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"{path} is not valid YAML{at}: {getattr(err, 'problem', None) or err}", key) from None
    entries = raw.get("tools") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} must hold `tools:` with a non-empty list of tools, e.g. tools: [{{name: calculator, "
                          "description: ..., parameters: [{name: a, type: number, description: ...}]}]", key)
    tools: dict[str, Tool] = {}
    base = os.path.dirname(os.path.abspath(path))
    for i, entry in enumerate(entries):
        tool = _parse_entry(entry, i, path, base, key)
        if tool.name in tools:
            raise ConfigError(f"{path}: tools[{i}] repeats the name {tool.name!r}; tool names must be unique", key)
        tools[tool.name] = tool
    missing = [t.name for t in tools.values() if t.fn is None]
    if missing:
        log.warning("%s: tool%s %s ha%s no implementation; a call returns an error to the model (add "
                    "`implementation: pkg.module:function` or `file.py:function` to the entry)", path,
                    "s" if len(missing) > 1 else "", ", ".join(map(repr, missing)), "ve" if len(missing) > 1 else "s")
    return tools


def _parse_entry(entry: Any, i: int, path: str, base: str, key: str) -> Tool:
    where = f"{path}: tools[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping with name, description and parameters, got "
                          f"{type(entry).__name__}", key)
    # OpenAI's {type: function, function: {...}} and verl's {tool_schema: {...}} wrap the same fields.
    body = entry
    if isinstance(entry.get("tool_schema"), dict):
        body = entry["tool_schema"]
    if isinstance(body.get("function"), dict):
        body = body["function"]
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where} needs a `name` (letters, digits, _ . -; starting with a letter or _), got "
                          f"{name!r}", key)
    where = f"{path}: tools[{i}] ({name!r})"
    description = body.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}: description must be a string", key)
    parameters = _parameters(body.get("parameters"), where, key)
    timeout = entry.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ConfigError(f"{where}: timeout_s must be a number of seconds > 0, got {timeout!r}", key)
    known = {"name", "description", "parameters", "implementation", "timeout_s", "type", "function", "tool_schema",
             "class_name", "config"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; an entry takes name, description, parameters, "
                          "implementation, timeout_s", key)
    tool = Tool(name, description, parameters, timeout_s=float(timeout) if timeout is not None else None)
    impl = entry.get("implementation")
    if impl is not None:
        if not isinstance(impl, str) or ":" not in impl:
            raise ConfigError(f"{where}: implementation must be 'pkg.module:function', 'path/file.py:function' or "
                              f"'builtin:<name>', got {impl!r}", key)
        tool.implementation = resolve_spec(impl, base)
        tool.fn = load_implementation(tool.implementation, f"{where}.implementation", key)
        _check_signature(tool, where, key)
    elif "class_name" in entry:
        # A verl BaseTool class needs verl's async tool runtime; accepting it would fail every call.
        raise ConfigError(f"{where}: class_name {entry['class_name']!r} is a verl tool class, which megarl does not "
                          "run; add `implementation: pkg.module:function` (a function taking the tool's arguments)",
                          key)
    elif name in builtins.BUILTINS:
        fn = builtins.BUILTINS[name]
        if set(inspect.signature(fn).parameters) == set(parameters.get("properties") or {}):
            tool.implementation, tool.fn = f"builtin:{name}", fn
            log.info("%s uses megarl's built-in %s: %s", where, name, (fn.__doc__ or "").strip())
        else:
            log.warning("%s: megarl's built-in %r takes (%s); this entry's parameters differ, so it has no "
                        "implementation", where, name, ", ".join(inspect.signature(fn).parameters))
    return tool


def _parameters(raw: Any, where: str, key: str) -> dict[str, Any]:
    """verl's rollout-guide list of {name, type, description} or a JSON schema object -> a JSON schema object."""
    if raw is None:
        return {"type": "object", "properties": {}, "required": []}
    if isinstance(raw, dict):
        props = raw.get("properties", {})
        if raw.get("type", "object") != "object" or not isinstance(props, dict):
            raise ConfigError(f"{where}: parameters as a JSON schema must be {{type: object, properties: {{...}}}}",
                              key)
        for pname, spec in props.items():
            if not isinstance(spec, dict):
                raise ConfigError(f"{where}: parameters.properties.{pname} must be a mapping like {{type: string}}",
                                  key)
            spec.update(_checked_type(spec.get("type"), f"{where}: parameter {pname!r}", key))
        required = raw.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ConfigError(f"{where}: parameters.required must list names among its properties", key)
        return {"type": "object", **raw, "properties": props, "required": list(required)}
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: parameters must be a list of {{name, type, description}} (or a JSON schema "
                          f"object), got {type(raw).__name__}", key)
    props, required = {}, []
    for j, p in enumerate(raw):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not p["name"]:
            raise ConfigError(f"{where}: parameters[{j}] needs a name; each parameter is {{name, type, description}}",
                              key)
        pname = p["name"]
        if pname in props:
            raise ConfigError(f"{where}: parameter {pname!r} appears twice", key)
        unknown = sorted(set(p) - {"name", "type", "description", "required", "enum", "items", "default"})
        if unknown:
            raise ConfigError(f"{where}: parameters[{j}] ({pname!r}) has unknown key {unknown[0]!r}; a parameter "
                              "takes name, type, description, required, enum", key)
        spec = {k: v for k, v in p.items() if k not in ("name", "required")}
        spec.update(_checked_type(p.get("type"), f"{where}: parameter {pname!r}", key))
        props[pname] = spec
        if p.get("required", "default" not in p):
            required.append(pname)
    return {"type": "object", "properties": props, "required": required}


def _checked_type(kind: Any, where: str, key: str) -> dict[str, Any]:
    if kind is None:
        return {}
    if isinstance(kind, str):
        kind = TYPE_ALIASES.get(kind.lower(), kind.lower())
        if kind in JSON_TYPES:
            return {"type": kind}
    raise ConfigError(f"{where} has type {kind!r}; use one of {', '.join(JSON_TYPES)}", key)


def resolve_spec(spec: str, base: str) -> str:
    """A file path in `path.py:function` made absolute (against `base`, then the working directory)."""
    target, _, attr = spec.rpartition(":")
    if target == "builtin" or not (target.endswith(".py") or os.sep in target):
        return spec
    for root in (base, os.getcwd()):
        candidate = os.path.abspath(os.path.join(root, os.path.expanduser(target)))
        if os.path.isfile(candidate):
            return f"{candidate}:{attr}"
    return spec                                 # load_implementation reports the missing file


def load_implementation(spec: str, where: str, key: str = TOOLS_KEY) -> Callable[..., Any]:
    """`builtin:name`, `pkg.module:function` or `/path/file.py:function` -> the callable."""

    target, _, attr = spec.rpartition(":")
    if target == "builtin":
        if attr not in builtins.BUILTINS:
            raise ConfigError(f"{where}: no built-in tool {attr!r}; built-ins: {', '.join(builtins.BUILTINS)}", key)
        return builtins.BUILTINS[attr]
    try:
        fn = get_attr(import_path(target, key), attr, key, "function")
    except ConfigError as err:
        raise ConfigError(f"{where}: {err.bare}", key) from None
    if not callable(fn):
        raise ConfigError(f"{where}: {spec} is not callable; name a function fn(**arguments) -> str | dict", key)
    return fn


def _check_signature(tool: Tool, where: str, key: str) -> None:
    try:
        sig = inspect.signature(tool.fn)
    except (TypeError, ValueError):
        return
    names = list((tool.parameters.get("properties") or {}))
    taken = [n for n in names if n in ROW_KWARGS]
    if taken:
        raise ConfigError(f"{where}: parameter {taken[0]!r} is the name of verl's per-row tools_kwargs, which megarl "
                          "passes from the row, not the model; rename the parameter", key)
    tool.row_kwargs = tuple(k for k in ROW_KWARGS if k in sig.parameters
                            and sig.parameters[k].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD))
    try:
        sig.bind_partial(**{n: None for n in names})
    except TypeError as err:
        raise ConfigError(f"{where}: implementation {getattr(tool.fn, '__name__', tool.fn)}{sig} cannot take the "
                          f"tool's parameters ({', '.join(names)}): {err}; rename one or the other", key) from None


def tool_text(value: Any) -> str:
    """What an implementation returned, as the text the model reads."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)
