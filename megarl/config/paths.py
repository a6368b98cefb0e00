"""Which config keys hold paths, and how a relative one is resolved.

A relative path written in a config file means "next to this file": it is made absolute against
the file's directory when the file is read (bases too, each against its own directory), so a
config runs the same from any working directory; one written with a ${...} reference (an
environment variable's default, another key) is taken from the same folder once resolved. A path
given on the command line is relative to the working directory, as every shell tool's is. Output
directories (trainer.default_local_dir, trainer.log_dir) are where a run writes, not inputs: they
stay relative to the working directory.
"""
from __future__ import annotations

import os
import re
from typing import Any

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def looks_like_hub_id(value: str) -> bool:
    """ORG/NAME, as a Hugging Face hub id is written (left as written when no such path exists)."""
    return bool(_HUB_ID.fullmatch(value)) and not value.startswith(".")


ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
# Keys whose values are input files or directories (or lists of them).
INPUT_PATH_KEYS = (
    "data.train_files", "data.val_files", "data.custom_cls.path",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path",
    "critic.model.path", "critic.model.tokenizer_path",
    "reward_model.model.path", "reward_model.model.tokenizer_path", "reward_model.model.input_tokenizer",
    "reward.reward_model.model_path",
    "custom_reward_function.path", "reward.custom_reward_function.path",    # verl 0.9.1's spelling of it
    "actor_rollout_ref.rollout.tools", "actor_rollout_ref.rollout.interactions",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
    "actor_rollout_ref.rollout.custom_cls_path",
    "trainer.resume_from_path",
    *(f"{role}.megatron.dist_checkpointing_path" for role in ROLES),
)
# Keys that may name a module instead of a file: resolved only when they look like a file path.
# Keys that may hold a hub id (ORG/NAME), which megarl refuses with the download command.
HUB_ID_OR_DIR = {"actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
                 "critic.model.tokenizer_path", "reward_model.model.path", "reward.reward_model.model_path"}
MODULE_OR_FILE = {"custom_reward_function.path", "reward.custom_reward_function.path",
                  "actor_rollout_ref.rollout.custom_cls_path", "data.custom_cls.path"}


def _looks_like_file(value: str) -> bool:
    return value.endswith(".py") or os.sep in value or value.startswith(".")


class PathInFile(str):
    """An input path written with a ${...} reference in a config file: it resolves later
    (interpolate.py), and what it resolves to is then taken from this file's folder, as a path
    written out in full would be."""
    base: str
    key: str

    def __new__(cls, text: str, base: str, key: str):
        self = super().__new__(cls, text)
        self.base, self.key = base, key
        return self

    def __reduce__(self):          # deepcopy (config merging) keeps the folder
        return PathInFile, (str(self), self.base, self.key)

    def resolved(self, value: Any) -> Any:
        return _resolve_one(value, self.base, self.key)


def _resolve_one(value: Any, base: str, key: str) -> Any:
    if isinstance(value, list):
        return [_resolve_one(v, base, key) for v in value]
    if isinstance(value, str) and "${" in value and not isinstance(value, PathInFile):
        return PathInFile(value, base, key)
    if not isinstance(value, str) or not value or "${" in value or value.startswith("~"):
        return value  # `~` is the user's home, not the file's folder
    if os.path.isabs(value) or (key in MODULE_OR_FILE and not _looks_like_file(value)):
        return value
    if key in HUB_ID_OR_DIR and looks_like_hub_id(value) and not os.path.exists(os.path.join(base, value)):
        return value  # verl's habit, a hub id: left as written so the error can say how to download it
    return os.path.normpath(os.path.join(base, value))


def resolve_file_paths(data: dict, base: str) -> dict:
    """`data` (one file's mapping, in place) with its relative input paths made absolute against `base`."""
    for key in INPUT_PATH_KEYS:
        *parents, leaf = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = _resolve_one(node[leaf], base, key)
    return data
