"""The launcher's checks that run the ranks' own data code (tokenizer, datasets, reward function),
so they load transformers and torch: megarl/launcher/preflight.py imports this module only once the config is
accepted and the model's tokenizer is on disk (`megarl-train --check`).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import traceback

from transformers import AutoTokenizer

from megarl.config.errors import ConfigError
from megarl.data.build import build_dataset
from megarl.data.dataset import RLDataset
from megarl.data.loader import PromptLoader
from megarl.models.hf_config import find_hf_config
from megarl.models.hf_overrides import check_override_keys
from megarl.reward.loading import load_reward_fn
from megarl.rollout.multiturn import prompt_tool_schemas

SAMPLED_ROWS = 32        # rows rendered before the whole file: enough to tell a template that inflates every one


def load_tokenizer(cfg):
    path = cfg.model.tokenizer_path or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as err:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(err).__name__}: {str(err).splitlines()[0]})",
                          "actor_rollout_ref.model.tokenizer_path") from None


def check_model_overrides(cfg) -> None:
    """Each role's model.override_config against its model's HF config (megarl/models/hf_overrides.py)."""
    roles = [("actor_rollout_ref.model", cfg.model, "actor_rollout_ref.actor.megatron")]
    if cfg.critic.enable:
        roles.append(("critic.model", cfg.critic.model, "critic.megatron"))
    for key, model, megatron_key in roles:
        hf = find_hf_config(model.path) if model.path else None
        if hf is not None:
            check_override_keys(hf, model.override_config, f"{key}.override_config", megatron_key)


def check_datasets(cfg, tokenizer):
    """Build the training and validation datasets as the ranks do; return the training dataset."""
    data = cfg.data
    tools = prompt_tool_schemas(cfg, tokenizer)     # measured as the agent loop renders them
    splits = [("train", data.train_files)] + ([("val", data.val_files)] if data.val_files else [])
    datasets = {}
    for split, files in splits:
        try:
            check_first_rows(data, files, tokenizer, split, tools)
            datasets[split] = build_dataset(data, files, tokenizer, split, tools)
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


def check_first_rows(data, files: list[str], tokenizer, split: str, tools) -> None:
    """SAMPLED_ROWS rows spread over the first file, rendered as the ranks render them: when every
    one is over data.max_prompt_length (nearly every row would be dropped), the chat template
    inflates them or the limit is too low. Said before the whole file is rendered."""
    if not files or not data.filter_overlong_prompts or (data.custom_cls or {}).get("path"):
        return
    r = RLDataset(files[0], tokenizer, data, split, tools, sample_rows=SAMPLED_ROWS).report
    if r["filtered_overlong"] and r["filtered_overlong"] == r["rows"] - r["malformed"]:
        template = data.chat_template or "the tokenizer's own"
        template = template if len(template) <= 40 else "a Jinja string"
        raise ConfigError(f"all {r['filtered_overlong']} prompts sampled across {files[0]} render to more than "
                          f"data.max_prompt_length={data.max_prompt_length} tokens (data.chat_template: {template}); "
                          "fix the template or the rows, or raise data.max_prompt_length", f"data.{split}_files")


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
    # In a child process under the run's own per-sample limit: a reward that hangs is killed, and one
    # that ends its process (os._exit, sys.exit, a signal) ends the child, not the launcher silently.
    # Forked, so the loaded function and the row need no pickling.
    key = "custom_reward_function.path" if spec.path else "data.reward_fn_key"
    what = f"scoring the first training row (data_source={source!r})"
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_score_in_child, args=(call, send), daemon=True, name="megarl-reward-check")
    child.start()
    send.close()
    child.join(cfg.reward_model.timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        raise ConfigError(f"{what} did not return within reward_model.timeout_s={cfg.reward_model.timeout_s:g} s, "
                          "the run's per-sample limit; fix the reward function or raise reward_model.timeout_s", key)
    try:
        outcome = recv.recv() if recv.poll() else None
    except EOFError:                     # the child ended before sending anything
        outcome = None
    recv.close()
    if outcome is None:
        code = child.exitcode or 0
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code} (os._exit?)"
        raise ConfigError(f"{what} ended the reward's process ({how}) instead of returning a score; a reward "
                          "function must return a number, not exit", key)
    if outcome[0] == "exit":
        raise ConfigError(f"{what} called sys.exit({outcome[1]}) at {outcome[2]} instead of returning a score; "
                          "a reward function must return a number, not exit", key)
    if outcome[0] == "raised":
        raise ConfigError(f"{what} raised {outcome[1]}: {outcome[2]} at {outcome[3]}; fix the reward function or "
                          "the rows", key)
    check_filter_metric(cfg, outcome[1])


def check_filter_metric(cfg, info_keys: list[str]) -> None:
    """DAPO's dynamic sampling filters on a per-sample field: the reward must give it (else the first
    step fails inside the sampler). `info_keys`: what the reward returned beside its score."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable or fg.metric in ("seq_reward", "seq_final_reward", "score"):
        return
    added = ["reward_failed"] + (["format"] if cfg.reward_model.format_reward != "none" else []) + (
        ["overlong_reward"] if cfg.algorithm.overlong_buffer.enable else [])
    if fg.metric not in [*info_keys, *added]:
        given = ", ".join(sorted(info_keys)) or "only a number"
        raise ConfigError(f"{fg.metric!r} is not a field the reward gives (scoring the first training row, it "
                          f"returned {given}); return a dict with {fg.metric!r}, or filter on score / seq_reward",
                          "algorithm.filter_groups.metric")


def _score_in_child(call, send) -> None:
    try:
        out = call()
        if isinstance(out, (list, tuple)) and out:      # a batch reward: one result per row
            out = out[0]
        outcome: tuple = ("ok", sorted(map(str, out)) if isinstance(out, dict) else [])
    except SystemExit as err:
        outcome = ("exit", repr(err.code), _user_frame(err))
    except BaseException as err:    # reported by the parent with the user's file and line
        outcome = ("raised", type(err).__name__, _one_line(err), _user_frame(err))
    send.send(outcome)
    send.close()
    os._exit(0)    # no atexit handlers or finalizers of the launcher's state in a forked copy


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
