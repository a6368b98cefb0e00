"""verl 0.9.1's own functions as test oracles, taken from its installed source one at a time.

verl installed with --no-deps cannot import its trainer modules (they need tensordict, ray,
omegaconf), but the functions that define its dumps and metrics use only numpy and the standard
library. This compiles the named function (or a class's method) from verl's file, unchanged, into a
namespace holding what it uses.

    write = verl_function("trainer/ppo/ray_trainer.py", "_write_generations", cls="RayPPOTrainer")
"""
import ast
import importlib.machinery
import importlib.util
import json
import os
from collections import defaultdict
from functools import partial
from typing import Any, Callable

import numpy as np
import pytest

REASON = "the oracle is verl 0.9.1's source: pip install --no-deps verl==0.9.1"


def verl_root() -> str:
    # PathFinder searches sys.path only: a test may have left a stand-in `verl` in sys.modules.
    spec = importlib.machinery.PathFinder.find_spec("verl")
    if spec is None or spec.origin is None:
        pytest.skip(REASON)
    return os.path.dirname(spec.origin)


def verl_function(path: str, name: str, cls: str | None = None, namespace: dict | None = None) -> Callable:
    """The function `name` (a method of `cls` if given) of verl's `path`, compiled alone; other verl
    functions it calls must be put in `namespace` (e.g. taken the same way)."""
    file = os.path.join(verl_root(), path)
    tree = ast.parse(open(file).read(), file)
    body = tree.body
    if cls is not None:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == cls)
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []          # @staticmethod: the bare function is what a test calls
    scope = {"np": np, "json": json, "os": os, "defaultdict": defaultdict, "partial": partial, "Any": Any,
             "Callable": Callable, "print": lambda *a, **k: None, **(namespace or {})}
    exec(compile(ast.Module(body=[node], type_ignores=[]), file, "exec"), scope)
    return scope[name]
