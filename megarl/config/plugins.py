"""Loading a user's code named in a config: a module from a .py file or an import path, an object
or class from `pkg.module:name` / `file.py:name`, a call checked against a signature, a class
built with the arguments its __init__ takes. Every failure is one ConfigError naming the key.

    fn = load_object("my_reward.py:compute_score", "custom_reward_function.path")
    cls = load_class("pkg.datasets:MyDataset", "data.custom_cls")

Rewards, datasets, tools, interactions and model bootstraps all load through here.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

from megarl.config.errors import ConfigError


def import_path(path: str, key: str):
    """A module from a .py file (loaded once per file) or from an importable module name."""
    if path.endswith(".py") or os.sep in path:
        full = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(full):
            raise ConfigError(f"file not found: {full}; give a .py file or an importable module", key)
        name = (f"megarl_user_{os.path.splitext(os.path.basename(full))[0]}_"
                f"{hashlib.sha1(full.encode()).hexdigest()[:8]}")
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, full)
        if spec is None or spec.loader is None:
            raise ConfigError(f"cannot load {full} as a Python module; give a .py file or an importable module", key)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module             # registered first so the file's own pickling works
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise ConfigError(f"importing {full} failed: {type(err).__name__}: {err}", key) from None
        return module
    try:
        return importlib.import_module(path)
    except Exception as err:
        raise ConfigError(f"cannot import module {path!r}: {type(err).__name__}: {err}; give a .py file "
                          "path or a module on PYTHONPATH", key) from None


def get_attr(module, name: str, key: str, what: str):
    if not hasattr(module, name):
        have = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                      and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{module.__name__} has no {what} named {name!r}; "
                          f"it defines: {', '.join(have) or 'nothing callable'}", key)
    return getattr(module, name)


def load_object(ref: str, key: str, what: str = "function"):
    """`pkg.module:name` or `path/file.py:name` -> the object, with one-line errors naming `key`."""
    path, _, name = ref.rpartition(":")
    if not path or not name:
        raise ConfigError(f"{ref!r} is not an import path; write 'pkg.module:{what}' or 'file.py:{what}'", key)
    return get_attr(import_path(path, key), name, key, what)


def check_signature(fn, names: tuple[str, ...], kwargs: dict, key: str) -> None:
    """Refuse a function that cannot be called as fn(**{names}, **kwargs), in one line."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return                                  # builtins and C functions: nothing to inspect
    try:
        sig.bind(**{n: None for n in names}, **kwargs)
    except TypeError as err:
        call = ", ".join(names) + (", " + ", ".join(f"{k}=..." for k in kwargs) if kwargs else "")
        raise ConfigError(f"{getattr(fn, '__name__', fn)}{sig} cannot be called as ({call}): {err}; "
                          f"the signature must accept those keyword arguments", key) from None


def load_class(ref: str, key: str, builtins: tuple[str, ...] = ()):
    """`pkg.module:Class` or `path/to/file.py:Class`; `builtins` are the key's own names, for the error."""
    if ":" not in ref:
        names = ", ".join(builtins) + " or " if builtins else ""
        raise ConfigError(f"{ref!r} is not {names}an import path; write 'pkg.module:Class' or 'path/to/file.py:Class'",
                          key)
    path, name = ref.rsplit(":", 1)
    cls = get_attr(import_path(path, key), name, key, "class")
    if not inspect.isclass(cls) and not callable(cls):
        raise ConfigError(f"{ref} is not a class", key)
    return cls


def construct(cls, available: dict[str, Any], user_kwargs: dict[str, Any], key: str):
    """Instantiate `cls` with the user's kwargs plus whichever of `available` its __init__ takes."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return cls(**user_kwargs)
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in available.items() if takes_any or k in params}
    kwargs.update(user_kwargs)
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"cannot construct {cls.__name__}{sig}: {err}; pass its arguments in "
                          f"{key.rsplit('.', 1)[0]}.reward_manager_kwargs", key) from None
    return cls(**kwargs)


def import_external_libs(cfg) -> None:
    """model.external_lib (verl's key): a module imported before any model is built, e.g. one that
    registers a custom architecture with transformers. Run in the launcher and on every rank."""
    for key, lib in (("actor_rollout_ref.model.external_lib", cfg.model.external_lib),
                     ("critic.model.external_lib", cfg.critic.model.external_lib),
                     ("reward_model.model.external_lib", (cfg.reward_model.model or {}).get("external_lib"))):
        if lib:
            try:
                importlib.import_module(lib)
            except Exception as err:
                raise ConfigError(f"cannot import {lib!r}: {type(err).__name__}: {err}; give a module on "
                                  "PYTHONPATH or remove the key", key) from None
