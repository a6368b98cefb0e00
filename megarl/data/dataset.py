"""The RL prompt dataset: verl-format rows -> rendered, tokenised, length-checked prompts.

    ds = RLDataset(["data/train.jsonl"], tokenizer, cfg.data)     # tools=schemas: as the agent loop renders
    ds[i] -> {raw_prompt, prompt_token_ids, data_source, reward_model, extra_info, index}
    ds.report -> {"rows", "kept", "malformed", "filtered_overlong", "truncated"}

Row format (verl's): `prompt` (data.prompt_key) is a string or a list of chat messages
({role, content}; a multi-turn history is the prompt as a whole, except that a list ending with an
assistant message follows verl's convention: all but the last message form the prompt and the
last one is the expected response, used as ground truth when the row has none); the ground truth is
`reward_model.ground_truth`, else a top-level `ground_truth` or `answer`; `data_source`
(data.reward_fn_key) picks the reward rule; `extra_info` is passed to the reward function.
"""
from __future__ import annotations

import logging
from typing import Any

from megarl.config.errors import ConfigError
from megarl.data.reading import BadRow, read_rows
from megarl.data.templates import render_prompt, resolve_chat_template

log = logging.getLogger("megarl.data")
ROLES = {"system", "user", "assistant", "tool", "function", "developer"}
# No tokenizer in use packs more characters than this into one token on average, so a prompt longer
# than max_prompt_length * this is over-length without tokenising it whole (a 100 MB row would
# otherwise cost minutes and gigabytes just to be dropped).
MAX_CHARS_PER_TOKEN = 128
# Rendered rows tokenized in one call: the tokenizer's batching without holding a whole file's text.
TOKENIZE_ROWS = 256


def check_prompt(prompt: Any, key: str) -> str | None:
    """Why `prompt` is unusable, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else f"empty '{key}'"
    if hasattr(prompt, "tolist"):                 # parquet gives numpy arrays for lists
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        return f"'{key}' must be a string or a non-empty list of messages, got {type(prompt).__name__}"
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            return f"'{key}'[{j}] must be {{role: {'/'.join(sorted(ROLES))}, content: str}}"
    if not any(m["content"].strip() for m in prompt):     # judged before the chat template renders it
        return f"empty '{key}' (every message's content is empty)"
    return None


def ground_truth(row: dict) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    for key in ("ground_truth", "answer"):
        if key in row:
            return row[key]
    return None


def _plain(value: Any) -> Any:
    """numpy arrays from parquet -> lists, recursively (so rows are plain Python)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class RLDataset:
    def __init__(self, files: str | list[str], tokenizer, config, split: str = "train",
                 tools: list[dict] | None = None, sample_rows: int | None = None):
        """sample_rows: a probe of that many rows spread evenly over each file (the launcher's
        --check); it reports what it kept and dropped and refuses nothing for having kept no row."""
        self.tokenizer, self.config, self.split = tokenizer, config, split
        self.sample_rows = sample_rows
        self.tools = tools      # the schemas the agent loop renders prompts with (measured with them)
        files = [files] if isinstance(files, str) else list(files)
        key = f"data.{split}_files"
        if not files:
            raise ConfigError(f"no {split} files given; set {key}", key)
        self.template = resolve_chat_template(config.chat_template, tokenizer)
        self.items: list[dict] = []
        self.report = {"rows": 0, "kept": 0, "malformed": 0, "filtered_overlong": 0, "truncated": 0}
        for path in files:
            self._load(path, key)
        if sample_rows is not None:
            return
        self._check_val_drops(files)
        if not self.items:
            raise ValueError(f"no usable {split} prompts in {', '.join(files)} (report: {self.report}); "
                             "check data.prompt_key and data.max_prompt_length")

    def summary(self) -> str:
        """One line for the start-up log: what was kept, dropped and truncated."""
        r = self.report
        return (f"{self.split} data: {r['kept']} of {r['rows']} rows kept; dropped {r['malformed']} malformed, "
                f"{r['filtered_overlong']} over data.max_prompt_length={self.config.max_prompt_length}; "
                f"truncated {r['truncated']}")

    def _check_val_drops(self, files: list[str]) -> None:
        if self.split != "val":
            return
        dropped = self.report["malformed"] + self.report["filtered_overlong"]
        limit = self.config.max_val_dropped_fraction
        if dropped and dropped / max(self.report["rows"], 1) > limit:
            raise ConfigError(f"{dropped} of {self.report['rows']} validation rows would be dropped "
                              f"({self.report['filtered_overlong']} over "
                              f"max_prompt_length={self.config.max_prompt_length}, "
                              f"{self.report['malformed']} malformed), more than "
                              f"data.max_val_dropped_fraction={limit}; "
                              "raise data.max_prompt_length, fix the rows, or raise that fraction knowingly",
                              "data.val_files")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    # -- loading -----------------------------------------------------------------------------------
    def _load(self, path: str, key: str) -> None:
        """Rows are rendered, sized and tokenized as they come, TOKENIZE_ROWS at a time: a row whose
        rendering is over the character bound is dropped (or cut) at once, so a chat template that
        inflates every prompt never has every rendered row held at the same time."""
        cfg = self.config
        got = read_rows(path, key)
        bad = list(got.bad)
        bound = cfg.max_prompt_length * MAX_CHARS_PER_TOKEN
        pending: list[tuple[str, dict, str, bool]] = []          # (where, row, text, cut by characters)
        rows, total = got.rows, got.total
        if self.sample_rows is not None and len(rows) > self.sample_rows:
            rows = [rows[i * len(rows) // self.sample_rows] for i in range(self.sample_rows)]
        if self.sample_rows is not None:          # the sample's own rows only: a probe, not the file's count
            bad, total = [], len(rows)
        for where, raw in rows:
            row = self._checked(_plain(raw), path, where, bad)
            if row is None:
                continue
            text = render_prompt(self.tokenizer, row[cfg.prompt_key], self.template, cfg.apply_chat_template,
                                 self.tools)
            if len(text) <= bound:
                pending.append((where, row, text, False))
            elif cfg.filter_overlong_prompts:
                self.report["filtered_overlong"] += 1
            else:
                pending.append((where, row, self._cut_chars(text, bound, path, where), True))
            if len(pending) >= TOKENIZE_ROWS:
                self._keep(pending, path)
                pending = []
        self._keep(pending, path)
        if self.sample_rows is None:
            self._account_bad(path, bad, total)
        else:
            self.report["malformed"] += len(bad)
        self.report["rows"] += total
        self.report["kept"] = len(self.items)

    def _checked(self, row: dict, path: str, where: str, bad: list[BadRow]) -> dict | None:
        """The row with its prompt in verl's shape, or None (the problem added to `bad`)."""
        cfg = self.config
        if cfg.prompt_key not in row:
            bad.append(BadRow(path, where, f"missing '{cfg.prompt_key}'"))
            return None
        problem = check_prompt(row[cfg.prompt_key], cfg.prompt_key)
        if problem is None and row.get("reward_model") is not None and not isinstance(row["reward_model"], dict):
            problem = "'reward_model' must be an object like {ground_truth: ...}"
        if problem is None and row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
            problem = "'extra_info' must be an object"
        if problem:
            bad.append(BadRow(path, where, problem))
            return None
        if isinstance(row[cfg.prompt_key], list) and row[cfg.prompt_key][-1]["role"] == "assistant":
            # verl's convention: all but the last message form the prompt, the last one is the
            # expected response (the ground truth unless the row gives one).
            *prompt, answer = row[cfg.prompt_key]
            if not prompt:
                bad.append(BadRow(path, where, f"'{cfg.prompt_key}' holds only an assistant message; "
                                               "the prompt is all messages but the last"))
                return None
            row = {**row, cfg.prompt_key: prompt}
            if ground_truth(row) is None:
                row["ground_truth"] = answer["content"]
        return row

    def _keep(self, sized: list[tuple[str, dict, str, bool]], path: str) -> None:
        """Tokenize rendered rows and keep those that fit data.max_prompt_length."""
        cfg = self.config
        templated = self.template is not None and cfg.apply_chat_template
        texts = [t for _, _, t, _ in sized]
        ids = self.tokenizer(texts, add_special_tokens=not templated)["input_ids"] if texts else []
        for (where, row, _, cut), tokens in zip(sized, ids):
            tokens = self._fit(tokens, path, where, cut)
            if tokens is None:
                continue
            rm = row.get("reward_model")
            rm = rm if isinstance(rm, dict) else {}
            self.items.append({
                "raw_prompt": row[cfg.prompt_key],
                "prompt_token_ids": list(tokens),
                "data_source": row.get(cfg.reward_fn_key),
                "reward_model": {**rm, "ground_truth": ground_truth(row)},
                "extra_info": row.get("extra_info") or {},
                "index": len(self.items),
            })

    def _account_bad(self, path: str, bad: list[BadRow], total: int) -> None:
        if not bad:
            return
        self.report["malformed"] += len(bad)
        shown = ", ".join(str(b) for b in bad[:10]) + (f", ... ({len(bad) - 10} more)" if len(bad) > 10 else "")
        limit = self.config.max_bad_row_fraction
        if len(bad) / max(total, 1) > limit:
            raise ValueError(f"{path}: {len(bad)} of {total} rows are malformed, more than "
                             f"data.max_bad_row_fraction={limit}; first: {shown}; fix the file or raise the limit")
        log.warning("%s: skipped %d malformed of %d rows: %s", path, len(bad), total, shown)

    def _cut_chars(self, text: str, bound: int, path: str, where: str) -> str:
        """A prompt over `bound` characters, cut to the characters truncation could keep (or refused)."""
        cfg = self.config
        if cfg.truncation == "error":
            raise ValueError(f"{path} {where}: prompt has over {bound} characters, over data.max_prompt_length="
                             f"{cfg.max_prompt_length} tokens; set data.filter_overlong_prompts=true, "
                             "data.truncation=left|right|middle, or shorten the row")
        if cfg.truncation == "left":
            return text[-bound:]
        if cfg.truncation == "right":
            return text[:bound]
        return text[:bound // 2] + text[len(text) - bound // 2:]

    def _fit(self, tokens: list[int], path: str, where: str, cut: bool = False) -> list[int] | None:
        """Apply data.max_prompt_length: drop (counted), truncate, or refuse."""
        cfg, limit = self.config, self.config.max_prompt_length
        if len(tokens) <= limit and not cut:
            return tokens
        if len(tokens) <= limit:                 # already cut by characters (_cut_chars)
            self.report["truncated"] += 1
            return tokens
        if cfg.filter_overlong_prompts:
            self.report["filtered_overlong"] += 1
            return None
        if cfg.truncation == "error":
            raise ValueError(f"{path} {where}: prompt has {len(tokens)} tokens, over data.max_prompt_length={limit}; "
                             "set data.filter_overlong_prompts=true, data.truncation=left|right|middle, "
                             "or raise the limit")
        self.report["truncated"] += 1
        if cfg.truncation == "left":
            return tokens[-limit:]
        if cfg.truncation == "right":
            return tokens[:limit]
        head = limit // 2
        return tokens[:head] + tokens[len(tokens) - (limit - head):]
