"""Simulated users between assistant turns (`rollout.interactions`, `multi_turn.interaction_config_path`).

    interactions: [conversation]              # verl's rollout-guide spelling
    interactions: [my_pkg.users:Retry]        # or path/file.py:respond

An interaction is asked after every assistant turn that ended without a tool call:

    respond(response: str, *, sample: dict, turn: int) -> str | None

`response` is that turn's text, `sample` holds the row's data_source, ground_truth, extra_info and
raw_prompt, `turn` counts assistant turns so far. A string is the next user message (rendered as
the chat template's user turn, loss mask 0); None ends the episode. At most
multi_turn.max_user_turns user turns (1 when unset) per trajectory.

Built in: `conversation`: the dataset's chat history is the prompt (megarl/data renders it) and
the model answers its last turn; no simulated user speaks. Name a function or class to add one.

interaction_config_path, verl's file layout: `interaction: [{name, class_name, config}]`, where
class_name is an import path (pkg.module.Class, pkg.module:Class or file.py:Class) of a class
built as Class(config) whose instances have the `respond` method above. With several interactions,
a row picks one by extra_info.interaction_kwargs.name (verl's key), else the first applies.
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import yaml

from megarl.config.errors import ConfigError
from megarl.config.loader import load_yaml_text
from megarl.config.plugins import get_attr, import_path

KEY = "actor_rollout_ref.rollout.interactions"
BUILTIN = {"conversation": None}           # None: no simulated user


def _load(ref: str, key: str, config: dict | None = None) -> Callable[..., Any]:
    if ":" in ref:
        path, name = ref.rsplit(":", 1)
    elif "." in ref and not ref.endswith(".py"):
        path, name = ref.rsplit(".", 1)
    else:
        raise ConfigError(f"unknown interaction {ref!r}; use {', '.join(BUILTIN)}, an import path "
                          "(pkg.module:Class or file.py:function), or define it in multi_turn.interaction_config_path",
                          key)
    obj = get_attr(import_path(path, key), name, key, "interaction")
    if inspect.isclass(obj):
        try:
            obj = obj(config or {}) if config is not None else obj()
        except Exception as err:      # the user's constructor: any failure is this one config line
            raise ConfigError(f"cannot construct {ref}: {type(err).__name__}: {err}", key) from None
        if not callable(getattr(obj, "respond", None)):
            raise ConfigError(f"{ref} has no respond(response, *, sample, turn) method (verl's async "
                              "generate_response API is not supported; add respond())", key)
        return obj.respond
    if not callable(obj):
        raise ConfigError(f"{ref} is not callable; give respond(response, *, sample, turn) -> str | None", key)
    return obj


def _from_file(path: str) -> dict[str, Callable[..., Any]]:
    key = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist", key)
    try:
        with open(path) as f:
            raw = load_yaml_text(f, path) or {}
    except yaml.YAMLError as err:      # a tag (!!python/...) or a syntax error: one line, as for tools.yaml
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"{path} is not valid YAML{at}: {getattr(err, 'problem', None) or err}", key) from None
    entries = raw.get("interaction") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path} must hold `interaction:` with a list of {{name, class_name, config}}", key)
    out = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            raise ConfigError(f"{path}: interaction[{i}] needs class_name (an import path of a class)", key)
        name = e.get("name") or e["class_name"].rsplit(".", 1)[-1]
        out[name] = _load(e["class_name"], f"{key} ({path}: interaction[{i}])", e.get("config") or {})
    return out


def load_interactions(names: list[str], config_path: str | None) -> dict[str, Callable[..., Any] | None]:
    """{name: respond function, or None for `conversation`}, in order; a bad entry is one ConfigError."""
    defined = _from_file(config_path) if config_path else {}
    out: dict[str, Callable[..., Any] | None] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise ConfigError(f"entry {i} must be a name or an import path, got {name!r}", KEY)
        if name in BUILTIN:
            out[name] = BUILTIN[name]
        elif name in defined:
            out[name] = defined[name]
        else:
            out[name] = _load(name, f"{KEY}[{i}]")
    for name, fn in defined.items():
        out.setdefault(name, fn)
    return out


def pick(interactions: dict[str, Callable[..., Any] | None], extra_info: Any) -> Callable[..., Any] | None:
    """The interaction of one row: extra_info.interaction_kwargs.name if given, else the first."""
    if not interactions:
        return None
    if isinstance(extra_info, dict):
        wanted = (extra_info.get("interaction_kwargs") or {}).get("name")
        if wanted is not None:
            if wanted not in interactions:
                raise ValueError(f"a row asks for interaction {wanted!r} but only {', '.join(interactions)} are "
                                 "configured (rollout.interactions / multi_turn.interaction_config_path)")
            return interactions[wanted]
    return next(iter(interactions.values()))
