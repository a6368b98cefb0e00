"""Checks of a checkpoint's weights against its config.json, from the safetensors headers alone
(safetensors.safe_open reads the JSON header and maps the file; no tensor is read).

    vocab   the embedding's and lm_head's rows equal config.json's vocab_size; otherwise the
            ranks build the model from config.json, load every other tensor, and stop at the
            first of these with a shape error from each rank
    tokenizer  its size is config.json's vocab_size less at most the rows models pad the
            vocabulary with; a directory without tokenizer files gives a 1-token tokenizer
            (transformers builds one from config.json alone), which tokenizes every prompt to nothing
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


# Models pad the embedding past the tokenizer for tensor-parallel shards (Megatron pads to 128 per
# TP rank, so up to 1024 at TP 8): Qwen2.5-7B holds 152064 rows for 151665 tokens, DeepSeek-V3 129280
# for 128815. More missing tokens than that (or than an eighth of a small vocabulary) is another
# model's tokenizer, or none at all.
VOCAB_PADDING = 1024


def vocab_padding(vocab: int) -> int:
    return min(VOCAB_PADDING, vocab // 8)


def check_tokenizer_size(tokens: int, model_path: str, tokenizer_path: str,
                         key: str = "actor_rollout_ref.model.tokenizer_path") -> None:
    """The tokenizer's size (len(tokenizer), added tokens included) against the vocab_size of the
    model's config.json (which check_model_paths has read and checked)."""
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = _vocab_size(json.load(f))
    if vocab is None or tokens >= vocab - vocab_padding(vocab):
        return
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    found = [f for f in files if os.path.isfile(os.path.join(tokenizer_path, f))]
    why = (f"it holds none of {', '.join(files)}, so transformers built a tokenizer from config.json alone" if not found
           else "it is not this model's tokenizer")
    raise ConfigError(f"the tokenizer in {tokenizer_path} has {tokens} tokens, but the model's vocab_size is {vocab} "
                      f"(more than the {vocab_padding(vocab)} rows a model pads its vocabulary with): {why}; copy the "
                      "model's tokenizer files there or set actor_rollout_ref.model.tokenizer_path to them", key)
