"""Checks of a checkpoint's weights against its config.json, from the safetensors headers alone
(safetensors.safe_open reads the JSON header and maps the file; no tensor is read).

    vocab   the embedding's and lm_head's rows equal config.json's vocab_size; otherwise the
            ranks build the model from config.json, load every other tensor, and stop at the
            first of these with a shape error from each rank
"""
from __future__ import annotations

import json
import os

from safetensors import safe_open

from megarl.config.errors import ConfigError

# The HF names of the tensors whose first dimension is the vocabulary (megarl/models/convert.py),
# matched as suffixes so a multimodal model's `model.language_model.embed_tokens.weight` counts.
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def _vocab_size(hf_config: dict) -> int | None:
    size = hf_config.get("vocab_size")
    if size is None and isinstance(hf_config.get("text_config"), dict):
        size = hf_config["text_config"].get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _files_to_read(path: str) -> list[str]:
    """The *.safetensors files that hold the vocabulary tensors: those the index maps them to, else all."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        named = {file for name, file in weight_map.items() if name.endswith(VOCAB_TENSORS)}
    else:
        named = set(os.listdir(path))
    # Only this directory's own safetensors files: an entry that leaves it is the index check's to refuse.
    return sorted(n for n in named if isinstance(n, str) and n.endswith(".safetensors") and os.path.basename(n) == n
                  and os.path.isfile(os.path.join(path, n)))


def check_vocab_size(hf_config: dict, path: str, key: str = "actor_rollout_ref.model.path") -> None:
    """Each vocabulary tensor's rows against config.json's vocab_size, one line naming both numbers.
    Run after check_weight_format (every header is then a valid safetensors header)."""
    vocab = _vocab_size(hf_config)
    if vocab is None:
        return
    for file in _files_to_read(path):
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            for name in sorted(k for k in f.keys() if k.endswith(VOCAB_TENSORS)):
                shape = f.get_slice(name).get_shape()
                if shape and shape[0] != vocab:
                    raise ConfigError(f"{os.path.join(path, 'config.json')} says vocab_size {vocab}, but {file} holds "
                                      f"{name} of shape {list(shape)} ({shape[0]} rows); the config and the weights "
                                      f"disagree: set vocab_size to {shape[0]} if the weights are right, or re-save "
                                      "the model", key)
