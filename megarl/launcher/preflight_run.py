"""The checks a rank would otherwise hit first, run once in the launcher (`megarl-train --check`
and every launch), so a bad input is one line and exit code 2 before any process starts.

    data      each split's prompt column exists and its first value is a prompt (tokenizer-free)
    model     the architecture is one megarl builds (megarl/models/spec.py)
    loggers   every trainer.logger backend's package is installed

The checks that tokenize the data and score a row live in megarl/launcher/preflight_data.py; the device
check in megarl/launcher/preflight.py.
"""
from __future__ import annotations

import importlib.util
import json
import os

from megarl.config.errors import ConfigError
from megarl.data.dataset import check_prompt
from megarl.models.spec import ModelSpec

LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_architecture(hf_config: dict, where: str) -> None:
    try:
        ModelSpec.from_hf_config(hf_config)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}", "actor_rollout_ref.model.path") from None


def check_score_head(path: str, key: str, instead: str) -> None:
    """A model read with its `score` head (the reward model, a critic with init_from=path) must have
    one with one label; the ranks would stop on it only after starting (reading the same config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    try:
        spec = ModelSpec.from_hf_config(hf)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}", key) from None
    if spec.head != "score":
        raise ConfigError(f"{path} holds {spec.architecture}, which has no `score` head; give an HF "
                          f"*ForSequenceClassification checkpoint with one label{instead}", key)
    if spec.num_labels != 1:
        raise ConfigError(f"{path}: its score head has {spec.num_labels} labels; a scalar score needs 1", key)


def check_loggers(cfg) -> None:
    for name in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"includes {name}, but the {package!r} package is not installed; pip install {package} "
                              "(or megarl[logging]), or remove it from the list", "trainer.logger")


def tokenizer_available(cfg) -> bool:
    """False while the model (and its tokenizer) is still to be bootstrapped."""
    path = cfg.model.tokenizer_path or cfg.model.path
    return bool(path) and os.path.isdir(path)


def check_columns(path: str, key: str, prompt_key: str) -> None:
    """The prompt column exists and its first value is a prompt (tokenizer-free, so it runs even
    while the model is still to be bootstrapped)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq  # optional dependency: only for .parquet files
        names = pq.read_schema(path).names
        first = None
        if prompt_key in names:
            table = pq.ParquetFile(path).read_row_group(0, columns=[prompt_key]) if pq.ParquetFile(
                path).num_row_groups else None
            first = table.slice(0, 1).to_pylist()[0] if table is not None and table.num_rows else None
    else:
        first = _first_json_row(path, ext)
        names = sorted(first) if isinstance(first, dict) else []
    if prompt_key not in names:
        raise ConfigError(f"{path} has no '{prompt_key}' column (it has: {', '.join(names) or 'none'}); set "
                          "data.prompt_key to the column holding the prompts (chat messages or text)", key)
    value = first.get(prompt_key) if isinstance(first, dict) else None
    problem = check_prompt(value, prompt_key) if value is not None else None
    if problem:
        raise ConfigError(f"{path}: first row: {problem}", key)


def _first_json_row(path: str, ext: str):
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        if ext == ".json":
            text = f.read()
            if text.lstrip().startswith("["):
                items = json.loads(text)
                return items[0] if items else None
            f.seek(0)
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
    return None
