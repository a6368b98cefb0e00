"""The checks a rank would otherwise hit first, run once in the launcher (`megarl-train --check`
and every launch), so a bad input is one line and exit code 2 before any process starts.

    data      each split's files read, columns and types checked, prompts rendered with the
              tokenizer's chat template and tokenized exactly as the ranks do (megarl/data), the
              usable rows after filtering compared with data.train_batch_size
    model     the architecture is one megarl builds (megarl/models/spec.py)
    device    trainer.device=cuda and GPU-only engines need a GPU here
    loggers   every trainer.logger backend's package is installed
    reward    the reward function scores one real row of the training data; on failure the
              line names the function's file and line
"""
from __future__ import annotations

import importlib.util
import os
import traceback

from megarl.config.errors import ConfigError

LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
GPU_ENGINES = ("trtllm",)


def check_architecture(hf_config: dict, where: str) -> None:
    from megarl.models.spec import ModelSpec
    try:
        ModelSpec.from_hf_config(hf_config)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}", "actor_rollout_ref.model.path") from None


def check_device(cfg) -> None:
    device, name = cfg.trainer.device, cfg.rollout.name
    if device == "cpu" and name not in GPU_ENGINES:
        return
    import torch
    if torch.cuda.is_available():
        return
    if device == "cuda":
        raise ConfigError("cuda, but this machine has no usable GPU (torch.cuda.is_available() is false); "
                          "set trainer.device=cpu (or auto) to train on CPU over gloo", "trainer.device")
    if name in GPU_ENGINES:
        raise ConfigError(f"{name} runs on NVIDIA GPUs only and this machine has none; use rollout.name=native",
                          "actor_rollout_ref.rollout.name")


def check_loggers(cfg) -> None:
    for name in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"includes {name}, but the {package!r} package is not installed; pip install {package} "
                              "(or megarl[logging]), or remove it from the list", "trainer.logger")


def load_tokenizer(cfg):
    from transformers import AutoTokenizer
    path = cfg.model.tokenizer_path or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as err:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(err).__name__}: {str(err).splitlines()[0]})",
                          "actor_rollout_ref.model.tokenizer_path") from None


def check_datasets(cfg, tokenizer):
    """Build the training and validation datasets as the ranks do; return the training dataset."""
    from megarl.data.build import build_dataset
    from megarl.data.loader import PromptLoader
    data = cfg.data
    splits = [("train", data.train_files)] + ([("val", data.val_files)] if data.val_files else [])
    datasets = {}
    for split, files in splits:
        try:
            datasets[split] = build_dataset(data, files, tokenizer, split)
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(_one_line(err), f"data.{split}_files") from None
    train = datasets["train"]
    try:
        PromptLoader(train, data.train_batch_size, data.shuffle, data.seed, drop_last=True)
    except ValueError as err:
        raise ConfigError(_one_line(err), "data.train_batch_size") from None
    return train


def check_reward_on_a_row(cfg, dataset) -> None:
    """Score the first training row with its own ground truth as the response."""
    kind = cfg.reward_model.reward_manager
    if kind not in ("naive", "batch") or cfg.reward_model.enable or len(dataset) == 0:
        return
    from megarl.reward.loading import load_reward_fn
    spec, fn = load_reward_fn(cfg.custom_reward_function, batched=kind == "batch")
    item = dataset[0]
    source = item.get("data_source")
    truth = (item.get("reward_model") or {}).get("ground_truth")
    extra = item.get("extra_info") or {}
    response = "" if truth is None else str(truth)
    try:
        if kind == "batch":
            fn(data_sources=[source], solution_strs=[response], ground_truths=[truth], extra_infos=[extra],
               **spec.kwargs)
        else:
            fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra, **spec.kwargs)
    except Exception as err:
        frame = _user_frame(err)
        raise ConfigError(f"scoring the first training row (data_source={source!r}) raised {type(err).__name__}: "
                          f"{_one_line(err)} at {frame}; fix the reward function or the rows",
                          "custom_reward_function.path" if spec.path else "data.reward_fn_key") from None


def _user_frame(err: BaseException) -> str:
    """file:line of the innermost frame outside Python's own library (the user's code, usually)."""
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        if "site-packages" not in frame.filename and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "(unknown)"


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def tokenizer_available(cfg) -> bool:
    """False while the model (and its tokenizer) is still to be bootstrapped."""
    path = cfg.model.tokenizer_path or cfg.model.path
    return bool(path) and os.path.isdir(path)


def check_columns(path: str, key: str, prompt_key: str) -> None:
    """The prompt column exists and its first value is a prompt (tokenizer-free, so it runs even
    while the model is still to be bootstrapped)."""
    from megarl.data.dataset import check_prompt
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq
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
    import json
    with open(path, encoding="utf-8") as f:
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
