"""The one reader of an HF checkpoint's config.json (the launcher, the checks, the engines and the
checkpoint reader all read it here). Plain json, no torch, so the launcher can use it.

    hf = read_hf_config("ckpt")              # dict; FileNotFoundError naming the fix if absent
    hf = find_hf_config("ckpt")              # dict, or None where there is no config.json yet
    V = hf_vocab_size("ckpt")                # its vocab_size, or None
    hf = with_overrides(hf, model.override_config)   # <role>.model.override_config applied
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def config_json(model_dir: str) -> str:
    return os.path.join(model_dir or "", "config.json")


def read_hf_config(model_dir: str) -> dict:
    path = config_json(model_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: point at an HF checkpoint directory (config.json + weights)")
    with open(path) as f:
        return json.load(f)


def find_hf_config(model_dir: str) -> dict | None:
    """read_hf_config, or None where the directory holds no config.json (not bootstrapped yet)."""
    return read_hf_config(model_dir) if os.path.isfile(config_json(model_dir)) else None


def hf_vocab_size(model_dir: str | None) -> int | None:
    hf = find_hf_config(model_dir) if model_dir else None
    return hf.get("vocab_size") if hf is not None else None


def hf_overrides(override_config: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config keys `<role>.model.override_config` sets, as plain dicts. verl's megatron
    scripts nest them under `model_config` (`+actor_rollout_ref.model.override_config.model_config.
    max_position_embeddings=32768`); verl 0.9.1 (verl/workers/config/model.py, HFModelConfig) then
    takes that entry in place of the whole mapping, and so does megarl."""
    chosen = override_config["model_config"] if "model_config" in override_config else override_config
    return _plain(chosen)


def with_overrides(hf: Mapping[str, Any], override_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with the overrides applied: a mapping merges into the attribute's mapping (a
    sub-config, rope_scaling), as verl's update_model_config sets each of its keys."""
    out = _plain(hf)
    _merge(out, hf_overrides(override_config))
    return out


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _plain(value: Any) -> Any:
    """Plain dicts and lists: a frozen config's mappings refuse the copies later code changes."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
