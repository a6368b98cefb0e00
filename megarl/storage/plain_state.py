"""Plain data on disk: what torch's weights-only unpickler reads without widening its allow-list.

    save_plain(obj, path)      # tensors, numbers, strings, None, dicts/lists/tuples of them,
                               # numpy arrays, and the classes registered with register()
    obj = load_plain(path)     # torch.load(weights_only=True): a pickle naming any other callable
                               # is refused by torch before anything runs

numpy arrays become tensors (object arrays lists), a registered class (DataProto, SamplingParams:
each registers itself where it is defined, so this module imports none of megarl) the plain
fields its encoder returns; loading rebuilds them with its decoder. Saving anything else is a TypeError naming where
it sits, so a checkpoint that could not be read back is never written.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_NDARRAY, _OBJECTS, _CLASS = "__megarl_ndarray__", "__megarl_objects__", "__megarl_class__"

# The only classes a checkpoint may name: name -> (class, encode to plain fields, decode from them).
_CLASSES: dict[str, tuple[type, Callable[[Any], dict], Callable[[dict], Any]]] = {}


def register(name: str, cls: type, encode: Callable[[Any], dict], decode: Callable[[dict], Any]) -> None:
    """Let `cls` (exactly, not subclasses) be saved as `encode(obj)`, itself made plain, and read
    back as `decode(fields)`."""
    _CLASSES[name] = (cls, encode, decode)


def register_dataclass(cls: type) -> None:
    register(cls.__name__, cls, lambda obj: {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)},
             lambda fields: cls(**fields))


def to_plain(obj, where: str = "state"):
    """Tensors, str/int/float/bool/None, and dicts, lists and tuples of them. numpy arrays become
    tensors (or lists for object arrays), and a registered class its encoder's fields. Anything
    else is a TypeError naming where it is."""
    if obj is None or type(obj) in (bool, int, float, str) or isinstance(obj, torch.Tensor):
        return obj        # exact types: a subclass (an IntEnum, say) would pickle its class
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return {_OBJECTS: [to_plain(x, f"{where}[]") for x in obj.ravel().tolist()], "shape": list(obj.shape)}
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy()), "dtype": obj.dtype.str}
    for name, (cls, encode, _) in _CLASSES.items():
        if type(obj) is cls:
            return {_CLASS: name, "fields": to_plain(encode(obj), where)}
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} of type {type(key).__name__} cannot be checkpointed")
        return {k: to_plain(v, f"{where}.{k}") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(x, f"{where}[{i}]") for i, x in enumerate(obj))
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be checkpointed "
                    "(only tensors, numbers, strings, numpy arrays and containers of them)")


def from_plain(obj):
    if isinstance(obj, dict):
        if _NDARRAY in obj:
            return obj[_NDARRAY].numpy().astype(np.dtype(obj["dtype"]), copy=False)
        if _OBJECTS in obj:
            out = np.empty(len(obj[_OBJECTS]), dtype=object)
            out[:] = [from_plain(x) for x in obj[_OBJECTS]]
            return out.reshape(obj["shape"])
        if _CLASS in obj:
            if obj[_CLASS] not in _CLASSES:
                raise ValueError(f"the file names class {obj[_CLASS]!r}, which megarl does not read from checkpoints")
            return _CLASSES[obj[_CLASS]][2](from_plain(obj["fields"]))
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(x) for x in obj)
    return obj


def save_plain(obj, path: str) -> None:
    torch.save(to_plain(obj), path)


def load_plain(path: str):
    """torch's weights-only unpickler with its own allow-list (tensors, storages, plain containers):
    a pickle that names any other callable is refused by torch before anything runs."""
    return from_plain(torch.load(path, map_location="cpu", weights_only=True))
