"""The launcher's checks that run the ranks' own data code (tokenizer, datasets, reward function),
so they load transformers and torch: megarl/launcher/preflight.py imports this module only once the config is
accepted and the model's tokenizer is on disk (`megarl-train --check`).
"""
from __future__ import annotations

import threading
import traceback

from transformers import AutoTokenizer

from megarl.config.errors import ConfigError
from megarl.data.build import build_dataset
from megarl.data.loader import PromptLoader
from megarl.reward.loading import load_reward_fn


def load_tokenizer(cfg):
    path = cfg.model.tokenizer_path or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as err:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(err).__name__}: {str(err).splitlines()[0]})",
                          "actor_rollout_ref.model.tokenizer_path") from None


def check_datasets(cfg, tokenizer):
    """Build the training and validation datasets as the ranks do; return the training dataset."""
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
    spec, fn = load_reward_fn(cfg.custom_reward_function, batched=kind == "batch")
    item = dataset[0]
    source = item.get("data_source")
    truth = (item.get("reward_model") or {}).get("ground_truth")
    extra = item.get("extra_info") or {}
    response = "" if truth is None else str(truth)
    if kind == "batch":
        call = lambda: fn(data_sources=[source], solution_strs=[response], ground_truths=[truth],  # noqa: E731
                          extra_infos=[extra], **spec.kwargs)
    else:
        call = lambda: fn(data_source=source, solution_str=response, ground_truth=truth,  # noqa: E731
                          extra_info=extra, **spec.kwargs)
    # In a daemon thread under the run's own per-sample limit: a reward that hangs must not hang the
    # launcher (the thread cannot be killed; it ends with the process).
    outcome: dict = {}
    worker = threading.Thread(target=_capture, args=(call, outcome), daemon=True, name="megarl-reward-check")
    worker.start()
    worker.join(cfg.reward_model.timeout_s)
    key = "custom_reward_function.path" if spec.path else "data.reward_fn_key"
    if worker.is_alive():
        raise ConfigError(f"scoring the first training row (data_source={source!r}) did not return within "
                          f"reward_model.timeout_s={cfg.reward_model.timeout_s:g} s, the run's per-sample limit; fix "
                          "the reward function or raise reward_model.timeout_s", key)
    err = outcome.get("error")
    if err is not None:
        frame = _user_frame(err)
        raise ConfigError(f"scoring the first training row (data_source={source!r}) raised {type(err).__name__}: "
                          f"{_one_line(err)} at {frame}; fix the reward function or the rows", key)


def _capture(call, outcome: dict) -> None:
    try:
        call()
    except Exception as err:    # reported by the caller with the user's file and line
        outcome["error"] = err


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
