"""`${section.key}`, `${oc.select:section.key,default}` and `${env:NAME,default}` references
inside string values (`oc.select` as OmegaConf reads it, for configs copied from verl: the key's
value where the key is set, null included, else the default, typed as YAML reads it, else null).
As in OmegaConf, `${.key}` names a key of the same section (`${..key}` one section up), and a
default may hold braces (`${oc.select:a.b,{}}`). A reference to a verl key megarl does not keep
reads verl's default for it (the `unset` the caller passes): that key can hold no other value.

Resolved once on the merged plain dict, before typing, so every component sees final values
(e.g. `default_local_dir: runs/${trainer.experiment_name}` or `${env:SLURM_JOB_ID,local}`).

A string built with an environment variable's value (a token: `api_key: ${oc.env:OPENAI_API_KEY}`) is a
FromEnv: it reads as the string, and what megarl writes or shows of the config (run/config.yaml,
--print-config, wandb's config) says `<from env NAME>` in the value's place (public_config).
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import yaml

from megarl.config.errors import ConfigError
from megarl.config.paths import PathInFile

_UNSET = object()


class FromEnv(str):
    """A config string holding environment values; `env`: (name, value) of each."""
    env: tuple[tuple[str, str], ...]

    def __new__(cls, text: str, env) -> "FromEnv":
        made = super().__new__(cls, text)
        made.env = tuple(dict.fromkeys(env))
        return made

    def __reduce__(self):                 # pickled and copied with its names (Ray workers, deepcopy)
        return FromEnv, (str(self), self.env)

    def public(self) -> str:
        """The string with each environment value replaced by `<from env NAME>`; wholly replaced where
        a value no longer shows in it as it came (a path made absolute, a value cut)."""
        text, hidden = str(self), True
        for name, value in sorted(self.env, key=lambda e: -len(e[1])):
            if value and value in text:
                text = text.replace(value, f"<from env {name}>")
            elif value:
                hidden = False
        return text if hidden else f"<from env {', '.join(name for name, _ in self.env)}>"


def public_config(tree: Any) -> Any:
    """A plain tree (to_dict's) with every FromEnv value shown as FromEnv.public()."""
    if isinstance(tree, FromEnv):
        return tree.public()
    if isinstance(tree, dict):
        return {k: public_config(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [public_config(v) for v in tree]
    return tree


# yaml.safe_dump of the config (ExperimentConfig.to_yaml) shows the public form, never the value.
yaml.add_representer(FromEnv, lambda dumper, value: dumper.represent_str(value.public()), Dumper=yaml.SafeDumper)


def _references(text: str) -> list[tuple[int, int, str]]:
    """(start, end, body) of each top-level `${...}` in `text`, braces inside a body balanced,
    so that verl's `${oc.select:key,{}}` is one reference with the default `{}`."""
    out, i = [], text.find("${")
    while i >= 0:
        depth, j = 0, i + 1
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if depth:                       # no closing brace: the rest is text, as OmegaConf would not read it
            break
        out.append((i, j + 1, text[i + 2:j]))
        i = text.find("${", j + 1)
    return out


def _absolute(ref: str, where: str) -> str:
    """`.key` -> a key beside `where`; `..key` -> one section up (OmegaConf's relative references)."""
    if not ref.startswith("."):
        return ref
    dots = len(ref) - len(ref.lstrip("."))
    section = re.sub(r"\[\d+\]", "", where).split(".")[:-dots]
    return ".".join([*section, ref[dots:]])


def _no_default(dotted: str) -> tuple[bool, Any]:
    return False, None


def _find(root: dict, dotted: str) -> Any:
    """The value at a dotted key, or _UNSET."""
    node: Any = root
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def _lookup(root: dict, dotted: str, where: str, unset: Callable[[str], tuple[bool, Any]]) -> Any:
    node = _find(root, dotted)
    if node is _UNSET:
        known, value = unset(dotted)
        node = value if known else _UNSET
    if node is _UNSET:
        raise ConfigError(f"refers to ${{{dotted}}}, which is not set; set it or remove the reference", where)
    return node


# A value built from references to values built from references ("${b}${b}..." ten levels down)
# grows exponentially; no real config value comes near this.
MAX_CHARS = 1_000_000


def resolve(root: dict, unset: Callable[[str], tuple[bool, Any]] = _no_default) -> dict:
    """`root` with every reference replaced. `unset(key)` -> (known, value) for a key `root` lacks
    (megarl/config/verl_keys.py verl_default: verl's default of a key megarl drops)."""
    done: dict[str, Any] = {}             # each referenced key resolves once, however often it is used

    def value_of(text: str, where: str, stack: tuple[str, ...]) -> Any:
        def one(ref: str) -> Any:
            ref = ref.strip()
            if ref.startswith(("env:", "oc.env:")):
                name, _, default = ref.split(":", 1)[1].partition(",")
                got = os.environ.get(name.strip())
                if got is None and not default:
                    raise ConfigError(f"environment variable {name.strip()} is not set; export it or give "
                                      f"a default as ${{env:{name.strip()},value}}", where)
                return FromEnv(got, [(name.strip(), got)]) if got is not None else default.strip()
            if ref.startswith("oc.select:"):
                key, comma, default = ref[len("oc.select:"):].partition(",")
                key = _absolute(key.strip(), where)
                if _find(root, key) is _UNSET and not unset(key)[0]:
                    return yaml.safe_load(default) if comma and default.strip() else None
                ref = key
            ref = _absolute(ref, where)
            if ref in stack:
                raise ConfigError(f"references form a cycle: {' -> '.join((*stack, ref))}", where)
            if ref not in done:
                target = _lookup(root, ref, where, unset)
                # a section (or list) is copied with its own references resolved, as a string is
                done[ref] = walk(target, ref, (*stack, ref)) if isinstance(target, (str, dict, list)) else target
            return done[ref]

        refs = _references(text)
        if len(refs) == 1 and refs[0][:2] == (0, len(text)):   # a lone reference keeps the value's type
            return one(refs[0][2])
        pieces: list[str] = []
        env: list[tuple[str, str]] = []
        last = 0
        for start, end, body in refs:
            got = one(body)
            env += getattr(got, "env", ())
            pieces += [text[last:start], str(got)]
            last = end
        out = "".join([*pieces, text[last:]])
        if len(out) > MAX_CHARS:
            raise ConfigError(f"references expand to over {MAX_CHARS} characters; reference fewer values, "
                              "or fewer values that are themselves built of references", where)
        return FromEnv(out, env) if env else out

    def walk(node: Any, where: str, stack: tuple[str, ...] = ()) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k), stack) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]", stack) for i, v in enumerate(node)]
        if isinstance(node, PathInFile):   # from a config file: relative to that file's folder
            return node.resolved(value_of(node, where, stack))
        if isinstance(node, str) and "${" in node:
            return value_of(node, where, stack)
        return node

    return walk(root, "")
