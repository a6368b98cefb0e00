"""The one reader of an HF checkpoint's config.json (the launcher, the checks, the engines and the
checkpoint reader all read it here). Plain json, no torch, so the launcher can use it.

    hf = read_hf_config("ckpt")              # dict; FileNotFoundError naming the fix if absent
    hf = find_hf_config("ckpt")              # dict, or None where there is no config.json yet
    V = hf_vocab_size("ckpt")                # its vocab_size, or None
"""
from __future__ import annotations

import json
import os


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
