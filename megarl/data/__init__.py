"""Prompt data: files -> rendered, tokenised prompts -> resumable batches of DataProto.

    reading.py    .jsonl / .json / .parquet rows, malformed rows reported with line numbers
    templates.py  chat templates (tokenizer's, named, or Jinja)
    dataset.py    RLDataset: validation, rendering, length filtering / truncation
    loader.py     PromptLoader: deterministic per-epoch order, exact resume, collate
    build.py      build_dataset / build_loaders from the config (a user's dataset class by path)
"""
import importlib

_EXPORTS = {"RLDataset": "dataset", "PromptLoader": "loader", "ResumableSampler": "loader", "collate": "loader",
            "build_dataset": "build", "build_loaders": "build"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megarl.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megarl.data' has no attribute {name!r}")
