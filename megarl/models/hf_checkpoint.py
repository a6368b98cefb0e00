"""Read and write HF checkpoint directories (config.json + safetensors, sharded or not).

    ckpt = HFCheckpoint("path/to/model")
    spec = ckpt.spec()                        # ModelSpec, or ValueError for an unsupported model
    ckpt.validate(spec, head="lm")            # every tensor present, every shape right (headers only)
    part = ckpt.read(Slice("model.layers.0.self_attn.q_proj.weight", 0, 0, 64))  # just those rows

Reading goes through `safe_open(...).get_slice`, so a rank touches only the bytes of its slices.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save

from megarl.models.convert import Slice, hf_shapes
from megarl.models.hf_config import find_hf_config, read_hf_config
from megarl.models.spec import ModelSpec

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
# Files besides weights that make an HF directory usable (tokenizer, generation defaults, chat template).
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "tokenizer.model", "generation_config.json", "chat_template.jinja", "added_tokens.json")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# What readers take for a model's weights: any *.safetensors (megarl's reader, without an index, reads
# them all), either index, and transformers' pickled forms. An export replaces all of them or none.
_WEIGHTS = re.compile(r".*\.safetensors|model\.safetensors\.index\.json|pytorch_model(-\d+-of-\d+)?\.bin"
                      r"|pytorch_model\.bin\.index\.json")


def weight_files(path: str) -> list[str]:
    """The weight files (and indexes) in `path`, sorted; [] for a missing directory."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if _WEIGHTS.fullmatch(n))


def check_target(path: str, overwrite: bool) -> list[str]:
    """The weight files an export into `path` replaces: ValueError (one line) when there are some
    and `overwrite` is off, so an export never leaves another model's shards or index beside its own
    (megarl's reader would follow a stale index, transformers the new file)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory; give a directory to export into")
    old = weight_files(path)
    if old and not overwrite:
        shown = ", ".join(old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
        raise ValueError(f"{path} already holds model weights ({shown}); export into an empty directory, or pass "
                         "--overwrite to replace them (they are removed)")
    return old


class HFCheckpoint:
    def __init__(self, path: str):
        self.path = path
        if find_hf_config(path) is None:
            raise ValueError(f"{path}: no config.json; point at an HF checkpoint directory")
        self.config = read_hf_config(path)
        self._map: dict[str, str] | None = None  # read on first use, after the config was judged
        self._handles: dict[str, object] = {}

    @property
    def _files(self) -> dict[str, str]:
        if self._map is None:
            self._map = self._weight_map()
        return self._map

    def _weight_map(self) -> dict[str, str]:
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index) and os.path.lexists(os.path.join(self.path, SINGLE)):
            # Two versions of the weights: transformers reads model.safetensors, the index names others.
            raise ValueError(f"{self.path}: holds both {SINGLE} and {INDEX}, two versions of the weights "
                             "(transformers reads the first, the index names others); remove the stale one")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
            # The index names files to open: one that leaves the directory (../../etc/shadow) is refused
            # before it is opened, naming the index and the entry.
            for file in sorted(set(map(str, weight_map.values()))):
                if os.path.basename(file) != file or file in (".", "..") or not file.endswith(".safetensors"):
                    raise ValueError(f"{index}: weight_map sends tensors to {file!r}, which is not a *.safetensors "
                                     f"file in {self.path}; fix or remove the index")
            return weight_map
        files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors weights (megarl reads safetensors only; "
                             "re-save the model with save_pretrained(safe_serialization=True))")
        out = {}
        for name in files:
            try:
                with safe_open(os.path.join(self.path, name), "pt") as f:
                    out.update({k: name for k in f.keys()})
            except Exception as err:  # safetensors raises its own error type for a bad header
                raise ValueError(f"{self.path}/{name}: not a readable safetensors file ({err})") from None
        return out

    def _handle(self, name: str):
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), "pt")
        return self._handles[file]

    # -- metadata ----------------------------------------------------------------------------------
    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.config)

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handle(name).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {code}; megarl reads F32/BF16/F16")
        return _DTYPES[code]

    def validate(self, spec: ModelSpec, head: str = "lm") -> None:
        """Every tensor the model needs is present with its shape; reads headers only."""
        for name, shape in hf_shapes(spec, head).items():
            if name not in self._files:
                hint = " (a critic built from a reward model needs its `score` head)" if name == "score.weight" else ""
                raise ValueError(f"{self.path}: tensor {name} is missing{hint}")
            got = self.shape(name)
            if got != shape:
                raise ValueError(f"{self.path}: tensor {name} has shape {list(got)}, expected {list(shape)} "
                                 "from config.json")
            self.dtype(name)

    # -- data --------------------------------------------------------------------------------------
    def read(self, piece: Slice) -> torch.Tensor:
        sl = self._handle(piece.hf_name).get_slice(piece.hf_name)
        if piece.dim is None:
            return sl[:]
        stop = max(piece.start, piece.stop)
        return sl[piece.start:stop] if piece.dim == 0 else sl[:, piece.start:stop]

    def read_full(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def write_new(directory: str, name: str, data: bytes) -> None:
    """`name` in `directory` written through a fresh file, O_EXCL | O_NOFOLLOW on a random temporary
    name, then renamed into place, all relative to the directory opened once without following a
    link: a link planted at either name, or put in the directory's place, is replaced or refused,
    never followed, and a reader never sees a half-written file."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def save_hf(path: str, tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
            aux_from: str | None = None, max_shard_bytes: int = 4 << 30, overwrite: bool = False) -> None:
    """Write an HF directory: config.json, safetensors shards (+ index when more than one), and the
    tokenizer/generation files copied from `aux_from`, each file through write_new. Weight files
    already there are refused (check_target) unless `overwrite`, which removes them first."""
    for name in check_target(path, overwrite):
        os.remove(os.path.join(path, name))
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        write_new(path, SINGLE, save(shards[0], metadata={"format": "pt"}))
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_new(path, file, save(shard, metadata={"format": "pt"}))
            weight_map.update({k: file for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        write_new(path, INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                          indent=2).encode())
    write_new(path, "config.json", json.dumps(config, indent=2).encode())
    if aux_from:
        for name in AUX_FILES:
            src = os.path.join(aux_from, name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, name)):
                with open(src, "rb") as f:
                    write_new(path, name, f.read())
