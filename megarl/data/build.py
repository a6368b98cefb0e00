"""The datasets and loaders a config asks for, including a user's dataset class by path.

    train_loader, val_loader = build_loaders(cfg.data, tokenizer)

A custom class (`data.custom_cls: {path: my_data.py, name: MyDataset}`, verl's keys) is built as
`MyDataset(data_files=..., tokenizer=..., config=cfg.data)` (it may take fewer of those) and must
have __len__ and __getitem__ returning dicts with `prompt_token_ids` or `input_ids` (list or
tensor), plus whatever else its reward needs; extra fields reach the reward manager's batch.
"""
from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.data.dataset import RLDataset
from megarl.data.loader import PromptLoader
from megarl.config.plugins import construct, load_class


def build_dataset(config, files: list[str], tokenizer, split: str = "train", tools: list[dict] | None = None):
    """`tools`: the schemas multi-turn prompts are rendered with (megarl/rollout/multiturn:
    prompt_tool_schemas), so their lengths are measured as the engine gets them."""
    custom = config.custom_cls or {}
    if not custom.get("path"):
        return RLDataset(files, tokenizer, config, split, tools)
    key = "data.custom_cls"
    if not custom.get("name"):
        raise ConfigError("needs both path and name, e.g. {path: my_data.py, name: MyDataset}", key)
    cls = load_class(f"{custom['path']}:{custom['name']}", key)
    dataset = construct(cls, {"data_files": files, "tokenizer": tokenizer, "config": config, "processor": None,
                              "split": split}, {}, key + ".name")
    for method in ("__len__", "__getitem__"):
        if not hasattr(dataset, method):
            raise ConfigError(f"{custom['name']} has no {method}; a dataset class needs __len__ and __getitem__", key)
    return dataset


def build_loaders(config, tokenizer, tools: list[dict] | None = None) -> tuple[PromptLoader, PromptLoader | None]:
    """Training loader (shuffled per data.shuffle/seed, partial last batch dropped) and validation
    loader (file order, everything in batches of data.val_batch_size or in one batch)."""
    train = build_dataset(config, config.train_files, tokenizer, "train", tools)
    train_loader = PromptLoader(train, config.train_batch_size, config.shuffle, config.seed, drop_last=True)
    val_loader = None
    if config.val_files:
        val = build_dataset(config, config.val_files, tokenizer, "val", tools)
        val_loader = PromptLoader(val, config.val_batch_size or len(val), shuffle=False, seed=config.seed,
                                  drop_last=False, split="val")
    return train_loader, val_loader
