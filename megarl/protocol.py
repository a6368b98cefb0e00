"""DataProto: the batch that flows through one RL step.

A batch holds, for B rows:
  batch            tensors whose first dimension is B            (TensorBatch; len() = B)
  non_tensor_batch numpy object arrays of length B               (prompts, ground truth, uids...)
  meta_info        plain values about the whole batch             (temperature, step, ...)

Keys used across megarl (each producer documents its own):
  data      raw_prompt, prompt_token_ids (list[int] per row), data_source, reward_model
            ({"ground_truth": ...}), extra_info, index, uid (one per prompt, shared by its n samples)
  rollout   responses [B, R] right-padded; response_mask [B, R] (1 = a model token that counts
            in the loss; 0 = padding or tool output); rollout_log_probs [B, R];
            input_ids [B, S] = prompt + response, right-padded, nothing padded inside a sequence
            (so plain causal attention is exact); prompt_lens [B]; response_lens [B];
            finish_reasons (object)
  trainer   old_log_probs, ref_log_prob, values, token_level_scores, token_level_rewards,
            advantages, returns: all [B, R] aligned with `responses`

Attribute access (`batch.responses`, `out.log_probs = t`) reads and writes those stores, so the
custom-rollout example of the seed documents works as written.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from megarl.storage import plain_state
from megarl.storage.plain_state import load_plain, save_plain

_OWN = ("batch", "non_tensor_batch", "meta_info")


class TensorBatch(MutableMapping):
    """Tensors that share a leading batch dimension. Like tensordict, len() is the batch size."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, batch_size: int | None = None):
        self._data: dict[str, torch.Tensor] = {}
        self._size = batch_size
        for key, value in (tensors or {}).items():
            self[key] = value

    @property
    def batch_size(self) -> int:
        return self._size or 0

    def __len__(self) -> int:
        return self.batch_size

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"batch[{key!r}] is a scalar; per-row tensors need a batch dimension")
        if self._size is None:
            self._size = value.shape[0]
        elif value.shape[0] != self._size:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows but the batch has {self._size}")
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self):
        return self._data.keys()

    def items(self):
        return self._data.items()

    def values(self):
        return self._data.values()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self._data.items())
        return f"TensorBatch(B={self._size}, {fields})"


def _as_object_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype == object:
        return value
    out = np.empty(len(value), dtype=object)
    for i, v in enumerate(value):
        out[i] = v
    return out


def _index(idx: Any, size: int) -> np.ndarray:
    if isinstance(idx, slice):
        return np.arange(size)[idx]
    if isinstance(idx, torch.Tensor):
        idx = idx.cpu().numpy()
    idx = np.asarray(idx)
    if idx.dtype == bool:
        if idx.shape[0] != size:
            raise IndexError(f"boolean mask of length {idx.shape[0]} for a batch of {size}")
        return np.nonzero(idx)[0]
    return idx.astype(np.int64).reshape(-1)


class DataProto:
    def __init__(self, batch: TensorBatch | dict | None = None, non_tensor_batch: dict | None = None,
                 meta_info: dict | None = None):
        object.__setattr__(self, "batch", batch if isinstance(batch, TensorBatch) else TensorBatch(batch))
        object.__setattr__(self, "non_tensor_batch",
                           {k: _as_object_array(v) for k, v in (non_tensor_batch or {}).items()})
        object.__setattr__(self, "meta_info", dict(meta_info or {}))
        self._check()

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None,
                  meta_info: dict | None = None) -> "DataProto":
        return cls(TensorBatch(tensors), non_tensors, meta_info)

    def _check(self) -> None:
        n = len(self)
        for key, arr in self.non_tensor_batch.items():
            if len(arr) != n and (self.batch.batch_size or self.batch._size is not None):
                raise ValueError(f"non_tensor_batch[{key!r}] has {len(arr)} rows but the batch has {n}")

    def __len__(self) -> int:
        if self.batch._size is not None:
            return self.batch.batch_size
        for arr in self.non_tensor_batch.values():
            return len(arr)
        return 0

    # -- attribute access to the stores (verl's custom-rollout example writes `out.responses = ...`) --
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        batch = object.__getattribute__(self, "batch")
        if name in batch:
            return batch[name]
        nt = object.__getattribute__(self, "non_tensor_batch")
        if name in nt:
            return nt[name]
        raise AttributeError(f"DataProto has no field {name!r}; tensors: {sorted(batch.keys())}, "
                             f"others: {sorted(nt.keys())}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            self.batch[name] = value
        elif isinstance(value, (list, tuple, np.ndarray)):
            if len(self) and len(value) != len(self):
                raise ValueError(f"{name} has {len(value)} rows but the batch has {len(self)}")
            self.non_tensor_batch[name] = _as_object_array(value)
        else:
            self.meta_info[name] = value

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    # -- selection -----------------------------------------------------------------------------
    def __getitem__(self, idx: Any) -> "DataProto":
        if isinstance(idx, str):
            return self.__getattr__(idx)
        if isinstance(idx, (int, np.integer)):
            idx = [int(idx)]
        rows = _index(idx, len(self))
        t = torch.as_tensor(rows, dtype=torch.long)
        batch = TensorBatch({k: v[t.to(v.device)] for k, v in self.batch.items()}, batch_size=len(rows))
        return DataProto(batch, {k: v[rows] for k, v in self.non_tensor_batch.items()}, self.meta_info)

    def select(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None) -> "DataProto":
        keys = list(self.batch.keys()) if batch_keys is None else list(batch_keys)
        nkeys = list(self.non_tensor_batch) if non_tensor_batch_keys is None else list(non_tensor_batch_keys)
        meta = self.meta_info if meta_info_keys is None else {k: self.meta_info[k] for k in meta_info_keys}
        return DataProto(TensorBatch({k: self.batch[k] for k in keys}, batch_size=len(self)),
                         {k: self.non_tensor_batch[k] for k in nkeys}, meta)

    def pop(self, batch_keys: Sequence[str] = (), non_tensor_batch_keys: Sequence[str] = ()) -> "DataProto":
        out = DataProto(TensorBatch({k: self.batch[k] for k in batch_keys}, batch_size=len(self)),
                        {k: self.non_tensor_batch[k] for k in non_tensor_batch_keys}, self.meta_info)
        for k in batch_keys:
            del self.batch[k]
        for k in non_tensor_batch_keys:
            del self.non_tensor_batch[k]
        return out

    def union(self, other: "DataProto") -> "DataProto":
        """Add `other`'s fields to this batch (same rows); a key present in both must match."""
        if len(other) != len(self):
            raise ValueError(f"union of batches with {len(self)} and {len(other)} rows")
        for k, v in other.batch.items():
            if k in self.batch and not torch.equal(self.batch[k], v):
                raise ValueError(f"union: tensor {k!r} differs between the two batches")
            self.batch[k] = v
        for k, v in other.non_tensor_batch.items():
            self.non_tensor_batch[k] = v
        self.meta_info.update(other.meta_info)
        return self

    # -- splitting and joining -----------------------------------------------------------------
    def split(self, size: int) -> list["DataProto"]:
        return [self[i:i + size] for i in range(0, len(self), size)]

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Equal parts, as data parallelism needs; refuses a batch that does not divide."""
        if len(self) % chunks:
            raise ValueError(f"cannot split {len(self)} rows into {chunks} equal chunks; "
                             f"make the batch a multiple of {chunks}")
        return self.split(len(self) // chunks)

    @staticmethod
    def concat(parts: Sequence["DataProto"]) -> "DataProto":
        parts = [p for p in parts if len(p)] or list(parts[:1])
        if not parts:
            return DataProto()
        keys = list(parts[0].batch.keys())
        for p in parts[1:]:
            if list(p.batch.keys()) != keys and set(p.batch.keys()) != set(keys):
                raise ValueError(f"concat: tensor keys differ ({sorted(keys)} vs {sorted(p.batch.keys())})")
        tensors = {k: _cat_padded([p.batch[k] for p in parts]) for k in keys}
        nt = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch}
        return DataProto(TensorBatch(tensors, batch_size=sum(len(p) for p in parts)), nt, parts[0].meta_info)

    def repeat(self, repeat_times: int, interleave: bool = True) -> "DataProto":
        """Each row `repeat_times` times: [a a b b] when interleaved (one prompt's n samples adjacent)."""
        n = len(self)
        rows = np.repeat(np.arange(n), repeat_times) if interleave else np.tile(np.arange(n), repeat_times)
        return self[rows]

    def reorder(self, indices: Any) -> None:
        new = self[indices]
        object.__setattr__(self, "batch", new.batch)
        object.__setattr__(self, "non_tensor_batch", new.non_tensor_batch)

    # -- misc ------------------------------------------------------------------------------------
    def to(self, device: str | torch.device) -> "DataProto":
        for k, v in list(self.batch.items()):
            self.batch[k] = v.to(device)
        return self

    def clone(self) -> "DataProto":
        return DataProto(TensorBatch({k: v.clone() for k, v in self.batch.items()}, batch_size=len(self)),
                         {k: copy.deepcopy(v) for k, v in self.non_tensor_batch.items()}, copy.deepcopy(self.meta_info))

    def save_to_disk(self, path: str) -> None:
        save_plain(self, path)

    @classmethod
    def load_from_disk(cls, path: str) -> "DataProto":
        """Read with torch's weights-only unpickler (megarl.storage.plain_state): loading runs no code."""
        got = load_plain(path)
        if not isinstance(got, cls):
            raise ValueError(f"{path} does not hold a DataProto")
        return got

    def __repr__(self) -> str:
        return (f"DataProto(B={len(self)}, batch={sorted(self.batch.keys())}, "
                f"non_tensor={sorted(self.non_tensor_batch)}, meta={sorted(self.meta_info)})")


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate on dim 0; right-pad dim 1 with zeros where widths differ (responses of
    different batches may have different maximum lengths; routed_experts [B, S, L, K] too)."""
    if tensors[0].dim() < 2 or len({t.shape[1:] for t in tensors}) == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors]
    return torch.cat(padded)


# A checkpoint (the async trainer's in-flight batch) may hold a DataProto: as its parts.
plain_state.register(
    "DataProto", DataProto,
    lambda d: {"batch": dict(d.batch.items()), "size": len(d), "non_tensor_batch": d.non_tensor_batch,
               "meta_info": d.meta_info},
    lambda f: DataProto(TensorBatch(f["batch"], batch_size=f["size"]), f["non_tensor_batch"], f["meta_info"]))
