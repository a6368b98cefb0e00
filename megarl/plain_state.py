"""Plain data on disk: what torch's weights-only unpickler reads without widening its allow-list.

    save_plain(obj, path)      # tensors, numbers, strings, None, dicts/lists/tuples of them,
                               # numpy arrays, megarl's DataProto, allow-listed dataclasses
    obj = load_plain(path)     # torch.load(weights_only=True): a pickle naming any other callable
                               # is refused by torch before anything runs

numpy arrays become tensors (object arrays lists), a DataProto its parts, an allow-listed
dataclass its fields; loading rebuilds them. Saving anything else is a TypeError naming where
it sits, so a checkpoint that could not be read back is never written.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

_NDARRAY, _OBJECTS, _DATAPROTO, _DATACLASS = ("__megarl_ndarray__", "__megarl_objects__", "__megarl_dataproto__",
                                               "__megarl_dataclass__")


def _allowed_dataclasses() -> dict:
    """The only classes a checkpoint may name (by this key); anything else is refused on save."""
    from megarl.rollout.sampling import SamplingParams
    return {"SamplingParams": SamplingParams}


def to_plain(obj, where: str = "state"):
    """Tensors, str/int/float/bool/None, and dicts, lists and tuples of them. numpy arrays become
    tensors (or lists for object arrays), megarl's batch container its parts, and the dataclasses
    named in _allowed_dataclasses() their fields. Anything else is a TypeError naming where it is."""
    from megarl.protocol import DataProto
    if obj is None or type(obj) in (bool, int, float, str) or isinstance(obj, torch.Tensor):
        return obj        # exact types: a subclass (an IntEnum, say) would pickle its class
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return {_OBJECTS: [to_plain(x, f"{where}[]") for x in obj.ravel().tolist()], "shape": list(obj.shape)}
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy()), "dtype": obj.dtype.str}
    if isinstance(obj, DataProto):
        return {_DATAPROTO: {"batch": dict(obj.batch.items()), "size": len(obj),
                             "non_tensor_batch": to_plain(obj.non_tensor_batch, f"{where}.non_tensor_batch"),
                             "meta_info": to_plain(obj.meta_info, f"{where}.meta_info")}}
    if dataclasses.is_dataclass(obj) and type(obj) in _allowed_dataclasses().values():
        return {_DATACLASS: type(obj).__name__,
                "fields": {f.name: to_plain(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}}
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
        if _DATAPROTO in obj:
            from megarl.protocol import DataProto, TensorBatch
            d = obj[_DATAPROTO]
            return DataProto(TensorBatch(d["batch"], batch_size=d["size"]), from_plain(d["non_tensor_batch"]),
                             from_plain(d["meta_info"]))
        if _DATACLASS in obj:
            cls = _allowed_dataclasses()[obj[_DATACLASS]]
            return cls(**{k: from_plain(v) for k, v in obj["fields"].items()})
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
