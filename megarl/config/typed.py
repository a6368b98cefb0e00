"""Plain dicts (from YAML and overrides) to typed dataclasses and back.

Each component owns a dataclass; `build(cls, raw)` checks every key and value against its
annotations and then runs the dataclass's own `__post_init__` checks. Errors name the full
dotted key, the bad value, the expected type and the closest valid key.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from megarl.config.errors import ConfigError


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config class's resolved field types. Resolving the string annotations is most of what a
    load costs, and a class's annotations do not change while the process runs."""
    return typing.get_type_hints(cls)


_MISSING = dataclasses.MISSING
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.I)

# What a typed key looks like. Anything else in a key position (a whole line of some other file read as
# YAML, say /etc/shadow's) is not echoed into the error.
_KEY_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def key_like(name) -> bool:
    return bool(_KEY_LIKE.fullmatch(str(name)))


def not_a_key(name, prefix: str) -> ConfigError:
    """The error for a key that is no name at all, which it does not echo."""
    return ConfigError(f"holds a key of {len(str(name))} characters that is not a name (is this file a megarl "
                       "config?); remove it", prefix or "(top level)")


def closest(name: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming key, value and expected type."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(err)
        # A value of the right shape that failed inside (a mapping for a section): its own error
        # names the leaf key and the fix, where "expected mapping | null" would hide both.
        inner = [e for e in errors if e.key and e.key != key]
        if inner:
            raise inner[0]
        raise _type_error(key, value, tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        allowed = ", ".join(repr(a) for a in get_args(tp))
        hint = closest(str(value), [str(a) for a in get_args(tp)])
        fix = f"; did you mean {hint!r}?" if hint else ""
        raise ConfigError(f"got {value!r}, expected one of {allowed}{fix}", key)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        return build(tp, value, prefix=key)
    if origin in (list, tuple):
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise _type_error(key, value, tp)
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        args = get_args(tp)
        if args:
            return {k: _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(key, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `1e-4` (no dot) as a string; users write it that way all the time.
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)
        raise _type_error(key, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        # YAML turns `name: 1e-3` or `tag: 7` into numbers; a str field takes their text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, value, tp)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _type_error(key, value, tp)


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return ConfigError(f"got {shown} ({type(value).__name__}), expected {_type_name(tp)}", key)


def plugin_field(cls: type) -> str | None:
    """The field of a section that gathers the keys a named plug-in adds to it (a policy loss's own
    keys beside loss_mode): declared with metadata {"plugin_keys": True}. The keys the section does
    not declare land there as given, and the plug-in's registry types and checks them."""
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("plugin_keys")), None)


def build(cls: type, raw: dict | None, prefix: str = "") -> Any:
    """Construct dataclass `cls` from a mapping, checking keys, types and the class's own rules."""
    raw = dict(raw or {})
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    gather = plugin_field(cls)
    if gather is not None:
        kwargs[gather] = {k: raw.pop(k) for k in list(raw) if k not in fields or k == gather}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            hint = closest(str(name), list(fields))
            fix = f"; did you mean '{prefix + '.' if prefix else ''}{hint}'?" if hint else (
                f"; valid keys here: {', '.join(sorted(fields))}")
            if not key_like(name):
                raise not_a_key(name, prefix)
            raise ConfigError(f"unknown key{fix}", key)
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None
    except TypeError as err:  # a required field without a default was not given
        raise ConfigError(str(err), prefix or cls.__name__) from None


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for YAML output and the run directory)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if f.metadata.get("plugin_keys"):        # a plug-in's keys sit beside the section's own
                out.update(value or {})
            else:
                out[f.name] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a dataclass tree accepts (for 'did you mean' across sections)."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("plugin_keys"):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        out.append(key)
        tp = hints[f.name]
        for cand in (tp, *get_args(tp)):
            if isinstance(cand, type) and dataclasses.is_dataclass(cand):
                out.extend(all_keys(cand, key))
                break
    return out


def defaults_of(cls: type) -> dict:
    """The defaults of a dataclass tree as plain dicts, without running the top class's checks."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("plugin_keys"):
            continue
        if f.default is not _MISSING:
            out[f.name] = to_dict(f.default)
        elif f.default_factory is not _MISSING:
            out[f.name] = to_dict(f.default_factory())
    return out


def open_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys whose values are free-form mappings (anything below them is accepted)."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("plugin_keys"):        # the whole section takes a plug-in's keys
            out.append(prefix)
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        cands = (tp, *get_args(tp))
        if any(c is dict or get_origin(c) is dict for c in cands):
            out.append(key)
        for cand in cands:
            if isinstance(cand, type) and dataclasses.is_dataclass(cand):
                out.extend(open_keys(cand, key))
                break
    return out


def require(cond: bool, key: str, message: str) -> None:
    """Raise a ConfigError for `key` unless `cond` holds (for __post_init__ checks)."""
    if not cond:
        raise ConfigError(message, key)


class FrozenConfigError(AttributeError):
    """Raised when code sets a field of a config that was frozen after validation."""


class Section:
    """Base of every config dataclass. An experiment tree is frozen once built and validated
    (`freeze`): setting a field then raises, so no part of a run changes what another part reads.
    Values derived later (the step count, known once the data is loaded) go in a resolved copy
    (`derive`), never into the tree itself."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenConfigError(f"{type(self).__name__}.{name}: the config is frozen once validated; build a "
                                    "new one (load_config with overrides, or dataclasses.replace)")
        object.__setattr__(self, name, value)


def _refuse(self, *args, **kwargs):
    raise FrozenConfigError(f"a {type(self).__name__[6:].lower()} in the config: the config is frozen once validated; "
                            "build a new one (load_config with overrides, or dataclasses.replace)")


class FrozenList(list):
    """A list field of a frozen config: reads like a list, refuses every change in place."""
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):            # pickling and deepcopy rebuild it without calling append
        return type(self), (list(self),)


class FrozenDict(dict):
    """A mapping field of a frozen config: reads like a dict, refuses every change in place."""
    __setitem__ = __delitem__ = __ior__ = pop = popitem = clear = update = setdefault = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


def freeze(obj: Any, path: str = "config") -> Any:
    """Freeze a config tree (every dataclass in it must be a Section): fields can no longer be set,
    and list/dict values become FrozenList/FrozenDict. Returns the frozen object."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if not isinstance(obj, Section):
            raise TypeError(f"{path} is a {type(obj).__name__}, not a megarl.config.typed.Section: derive config "
                            "dataclasses from Section so the built tree can be frozen")
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, freeze(getattr(obj, f.name), f"{path}.{f.name}"))
        object.__setattr__(obj, "_frozen", True)
    elif isinstance(obj, list) and not isinstance(obj, FrozenList):
        return FrozenList(freeze(v, f"{path}[{i}]") for i, v in enumerate(obj))
    elif isinstance(obj, dict) and not isinstance(obj, FrozenDict):
        return FrozenDict({k: freeze(v, f"{path}.{k}") for k, v in obj.items()})
    return obj


def derive(tree: Any, values: dict[str, Any]) -> Any:
    """A frozen copy of a frozen tree with `values` ({dotted path: value}) set: the resolved view
    of a run. The tree itself is left as it was."""
    out = copy.deepcopy(tree)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = out
        for name in parents:
            node = getattr(node, name)
        if not any(f.name == leaf for f in dataclasses.fields(node)):
            raise KeyError(f"no config field {path}")
        object.__setattr__(node, leaf, value)
    return out
