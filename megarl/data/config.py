"""Configuration of the prompt data (`data.*`), verl's keys and meanings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.typed import Section, require


@dataclass
class DataConfig(Section):
    train_files: str | list[str] = field(default_factory=list)  # .jsonl / .json / .parquet files
    val_files: str | list[str] = field(default_factory=list)
    prompt_key: str = "prompt"             # a string, or a list of chat messages
    reward_fn_key: str = "data_source"     # which field selects the rule reward
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 64             # prompts per step (before n samples each)
    val_batch_size: int | None = None      # None: the whole validation set in one pass
    chat_template: str | None = None       # None: the tokenizer's own; or chatml, llama3, plain, or a Jinja string
    apply_chat_template: bool = True       # False: string prompts are tokenized as they are
    # What to do with prompts longer than max_prompt_length: drop them (counted) when
    # filter_overlong_prompts, else keep the end (left), the start (right), both ends (middle),
    # or stop with an error.
    truncation: Literal["error", "left", "right", "middle"] = "error"
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    # null is verl's default: its shuffle then draws from torch.Generator()'s fixed built-in seed, the
    # same order every run. megarl reads null the same way, as its own fixed default seed, 1.
    seed: int | None = 1
    # Malformed rows are skipped and reported with their line numbers; above this fraction
    # of a file the load stops with an error instead.
    max_bad_row_fraction: float = 0.05
    # Validation rows dropped (malformed or over max_prompt_length) above this fraction of the
    # validation set stop the run: a metric over a silently smaller set is not the same metric.
    max_val_dropped_fraction: float = 0.0
    dataloader_num_workers: int = 0
    return_raw_chat: bool = False          # verl's key; megarl always keeps the chat (refused.py ALREADY)
    gen_batch_size: int | None = None      # verl's DAPO key, refused (refused.py): see algorithm.filter_groups
    custom_cls: dict[str, Any] = field(default_factory=dict)  # {path, name}: a user's dataset class

    def __post_init__(self):
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]
        if self.seed is None:
            self.seed = 1
        require(self.max_prompt_length >= 1, "max_prompt_length", "must be >= 1")
        require(self.max_response_length >= 1, "max_response_length", "must be >= 1")
        require(self.train_batch_size >= 1, "train_batch_size", "must be >= 1")
        require(self.val_batch_size is None or self.val_batch_size >= 1, "val_batch_size", "must be >= 1 or null")
        require(0.0 <= self.max_bad_row_fraction <= 1.0, "max_bad_row_fraction", "must be within [0, 1]")
        require(0.0 <= self.max_val_dropped_fraction <= 1.0, "max_val_dropped_fraction", "must be within [0, 1]")
