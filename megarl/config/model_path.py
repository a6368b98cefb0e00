"""A model path is what it says: a real checkpoint, or the one place a bootstrap may build.

- `actor_rollout_ref.model.bootstrap` builds only into the path its own config names (the file,
  with its bases, that sets `bootstrap:`; or the command line, when the command line sets it), and
  only when that path does not exist yet. A config that inherits a bootstrap but points
  `model.path` elsewhere (verl's `model.path=Qwen/Qwen2.5-0.5B-Instruct`, or a typo) loads that
  path, so a missing one is an error, not a toy model built there.
- A path that looks like a Hugging Face hub id (ORG/NAME) and is no directory here is read from the
  Hugging Face cache (HF_HOME) when a complete snapshot of it is there (`use_hub_cache`, at config
  load, on the launcher and every rank alike: local files only, nothing is downloaded); otherwise
  the error says how to download it.
- A path that is a file, or a directory without config.json, is an error; nothing is created.
"""
from __future__ import annotations

import os
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from megarl.config.errors import ConfigError
from megarl.config.interpolate import resolve
from megarl.config.loader import BASE_KEY, load_yaml_text, read_yaml
from megarl.config.paths import HUB_ID_OR_DIR, looks_like_hub_id

MODEL = ("actor_rollout_ref", "model")
KEY = "actor_rollout_ref.model.path"


def _model(raw: dict) -> dict:
    node: Any = raw
    for part in MODEL:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _own_path(config_path: str, seen: set[str] | None = None) -> tuple[bool, Any]:
    """(whether this file or one of its bases sets a bootstrap, the model path that file names).
    A file listed again is not searched again (read_yaml has bounded and checked the chain)."""
    seen = set() if seen is None else seen
    config_path = os.path.abspath(config_path)
    if config_path in seen:
        return False, None
    seen.add(config_path)
    with open(config_path) as f:
        alone = load_yaml_text(f, config_path) or {}
    if _model(alone).get("bootstrap"):
        return True, _model(read_yaml(config_path)).get("path")
    bases = alone.get(BASE_KEY) or []
    for base in reversed([bases] if isinstance(bases, str) else bases):   # the last base wins the merge
        base = base if os.path.isabs(base) else os.path.join(os.path.dirname(config_path), base)
        found, path = _own_path(base, seen)
        if found:
            return True, path
    return False, None


def confine_bootstrap(raw: dict, config_path: str | None, overrides: list[str]) -> dict:
    """`raw` (merged file + overrides) with model.bootstrap cleared where model.path is not the path
    the bootstrap's own config names (in place; returned for chaining)."""
    model = _model(raw)
    if not model.get("bootstrap"):
        return raw
    if any(o.split("=", 1)[0].lstrip("+") == "actor_rollout_ref.model.bootstrap" for o in overrides):
        return raw                     # the command line set the bootstrap: its path is the final one
    found, own = _own_path(config_path) if config_path else (False, None)
    if found and own != model.get("path"):
        model["bootstrap"] = None
    return raw


def cached_snapshot(repo_id: str) -> str | None:
    """The directory of `repo_id`'s snapshot (refs/main) in the Hugging Face cache when huggingface_hub
    finds it there complete, else None. Local files only: a rank never downloads."""
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def use_hub_cache(raw: dict) -> dict:
    """`raw` with each model key that holds a hub id, where no such directory exists, set to that
    id's snapshot in the Hugging Face cache when one is there (in place; returned for chaining)."""
    for key in sorted(HUB_ID_OR_DIR):
        *parents, leaf = key.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(value, str) and "${" in value:
            value = _env_only(value)
        if (isinstance(value, str) and "${" not in value and looks_like_hub_id(value) and not os.path.isabs(value)
                and not os.path.exists(value) and (snapshot := cached_snapshot(value))):
            node[leaf] = snapshot
    return raw


def _env_only(value: str) -> Any:
    """`value` with its references resolved where they are environment variables only (the shipped
    configs' `${env:MODEL,Qwen/Qwen2.5-7B-Instruct}`), so such a hub id reaches the cache too; None
    where it refers to other keys, which resolve later with the whole config."""
    try:
        return resolve({"path": value})["path"]
    except ConfigError:
        return None


def missing_model(path: str) -> ConfigError:
    if looks_like_hub_id(path) and not os.path.isabs(path):
        name = path.split("/")[-1]
        return ConfigError(f"{path} does not exist here and is not in the Hugging Face cache "
                           f"({constants.HF_HUB_CACHE}); it looks like a hub id, and megarl downloads nothing: run "
                           f"`hf download {path}` (into the cache; this path then works) or `hf download {path} "
                           f"--local-dir models/{name}` and set {KEY}=models/{name}", KEY)
    hint = " (relative paths in a config file are taken from that file's folder)" if not os.path.isabs(path) else ""
    return ConfigError(f"{path} does not exist{hint}; point it at an HF checkpoint directory (config.json + "
                       "*.safetensors). A model.bootstrap builds only the path its own config names", KEY)


def model_path_state(path: str, bootstrap: str | None) -> str:
    """'ready' (holds config.json) or 'bootstrap' (absent, and this config's bootstrap builds it);
    any other state raises a one-line ConfigError. Creates nothing."""
    if os.path.isfile(path):
        raise ConfigError(f"{path} is a file; give the HF checkpoint directory that holds config.json "
                          f"(e.g. {os.path.dirname(path) or '.'})", KEY)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "ready"
        fix = ("; the bootstrap builds only into a path that does not exist yet: remove the directory or point "
               "model.path elsewhere" if bootstrap else "; point it at an HF checkpoint directory")
        raise ConfigError(f"{path} exists but holds no config.json{fix}", KEY)
    if bootstrap:
        return "bootstrap"
    raise missing_model(path)
