"""YAML experiment files with bases, plus dotted command-line overrides.

    base: ppo_base.yaml          # or a list; paths relative to this file
    actor_rollout_ref:
      rollout: {n: 5}

Bases merge first (left to right), then the file itself, then `a.b.c=value` overrides.
Mappings merge key by key; lists and scalars replace. A value of `null` clears a key.
A key written twice in one mapping is an error (YAML would keep the last one silently).
Relative input paths in a file resolve against that file's directory (megarl/config/paths.py).
"""
from __future__ import annotations

import copy
import os
from typing import Any

import yaml

from megarl.config.errors import ConfigError
from megarl.config.paths import resolve_file_paths

BASE_KEY = "base"


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key repeated within one mapping, naming both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue     # `<<: *anchor`: SafeLoader merges it below; its keys may be overridden here
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"{self.name}: key {key!r} appears twice (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# Aliases share one node, so a few hundred bytes of nested anchors ("billion laughs") stand for
# billions of values once anything walks or copies them; configs hold a few thousand at most.
MAX_NODES = 200_000
MAX_BYTES = 2 << 20
MAX_DEPTH = 100


def _check_size(root: yaml.Node, name: str) -> None:
    """Refuse a document whose aliases expand past MAX_NODES or that nests past MAX_DEPTH, unexpanded."""
    seen: dict[int, tuple[int, int]] = {}          # id(node) -> (nodes with aliases expanded, height)

    def size(node: yaml.Node, depth: int) -> tuple[int, int]:
        got = seen.get(id(node))
        if depth + (got[1] if got else 0) > MAX_DEPTH:       # an alias cycle ends here too
            raise ConfigError(f"{name} line {node.start_mark.line + 1}: YAML nests over {MAX_DEPTH} levels "
                              "(or an alias refers to itself); flatten it")
        if got:
            return got
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        count, height = 1, 0
        for child in children:
            n, h = size(child, depth + 1)
            count, height = count + n, max(height, h + 1)
            if count > MAX_NODES:
                raise ConfigError(f"{name}: YAML aliases expand to over {MAX_NODES} values (nested anchors, a "
                                  "'billion laughs'); write the values out or use fewer nested aliases")
        seen[id(node)] = (count, height)
        return count, height

    size(root, 0)


def load_yaml_text(stream, name: str = "<string>"):
    """yaml.safe_load, except that a duplicate key, alias bombs and deep nesting are ConfigErrors."""
    loader = _UniqueKeyLoader(stream)
    loader.name = name
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:        # PyYAML composes recursively: thousands of nested brackets
            raise ConfigError(f"{name}: YAML nests too deeply to parse (over {MAX_DEPTH} levels is refused); "
                              "flatten it") from None
        if node is None:
            return None
        _check_size(node, name)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def deep_merge(into: dict, new: dict) -> dict:
    out = copy.deepcopy(into)
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# A chain of bases: verl's deepest composed config is 3 levels; a file listed twice is read once.
MAX_BASE_DEPTH = 32
MAX_BASE_FILES = 256


class _Chain:
    """One load's files: each parsed and merged once (by absolute path), their count and bytes bounded."""

    def __init__(self, top: str):
        self.top, self.bytes = top, 0
        self.merged: dict[str, dict] = {}

    def refuse(self, stack: tuple[str, ...], what: str, fix: str) -> ConfigError:
        chain = " -> ".join(os.path.basename(p) for p in stack)
        return ConfigError(f"{self.top}: config bases {what} ({chain}); {fix}")


def read_yaml(path: str) -> dict:
    """One config file with its bases resolved, as a plain dict."""
    path = os.path.abspath(path)
    return _read(path, (path,), _Chain(path))


def _read(path: str, stack: tuple[str, ...], chain: _Chain) -> dict:
    if path in chain.merged:                     # listed again (a diamond, or the same file twice)
        return chain.merged[path]
    if len(stack) > MAX_BASE_DEPTH:
        raise chain.refuse(stack[:3] + ("...",) + stack[-2:], f"nest over {MAX_BASE_DEPTH} levels",
                           "flatten the chain: a base may list several files")
    if len(chain.merged) >= MAX_BASE_FILES:
        raise chain.refuse(stack, f"name over {MAX_BASE_FILES} files", "merge some of them")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    chain.bytes += size
    # before parsing: YAML reads about 1 MB a second; one file over the bound alone gets _parse's line
    if chain.bytes > MAX_BYTES and chain.bytes > size:
        raise chain.refuse(stack, f"hold over {MAX_BYTES >> 20} MiB together", "a config holds keys, not data")
    data = _parse(path)
    resolve_file_paths(data, os.path.dirname(path))
    bases = data.pop(BASE_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    merged: dict = {}
    for base in bases:
        base_path = os.path.abspath(base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base))
        real = os.path.realpath(base_path)
        if not real.endswith((".yaml", ".yml")):   # a link to /etc/shadow: refused by name, never read
            raise ConfigError(f"{path}: {BASE_KEY}: {base} is {real}, not a .yaml/.yml file; a base is another "
                              "megarl config")
        if base_path in stack:
            raise chain.refuse((*stack, base_path), "form a cycle", f"remove one '{BASE_KEY}:' entry")
        merged = deep_merge(merged, _read(base_path, (*stack, base_path), chain))
    chain.merged[path] = deep_merge(merged, data)
    return chain.merged[path]


def _parse(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}; check the --config path")
    size = os.path.getsize(path)
    if size > MAX_BYTES:     # a config holds keys; YAML parses about 1 MB a second, so a huge one is a mistake
        raise ConfigError(f"{path}: {size / 2**20:.1f} MiB is over the {MAX_BYTES >> 20} MiB a config file may hold "
                          "(verl's largest composed tree is under 0.1 MiB); put data in data.train_files, not here")
    try:
        with open(path) as f:
            data = load_yaml_text(f, path) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML: 5 -> int, true -> bool, [1,2] -> list)."""
    if text.startswith("~"):
        raise ConfigError(f"override {text!r} is Hydra's deletion of a key; every megarl key has a default, which a "
                          "key left out takes: remove the override")
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value; write e.g. "
                          "actor_rollout_ref.rollout.n=5")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if key == "hydra" or key.startswith("hydra."):
        raise ConfigError(f"override {text!r} sets Hydra's own settings, which megarl does not run; a run writes to "
                          "trainer.default_local_dir (hydra.run.dir's place): set trainer.default_local_dir=<dir>")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part; write e.g. trainer.save_freq=10")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"cannot set '{'.'.join(path)}': '{'.'.join(path[:i + 1])}' is "
                                  f"{nxt!r}, not a section", ".".join(path))
            node = nxt
        node[path[-1]] = value
    return out
