"""A config.json whose vocab_size disagrees with its weights is refused by the preflight in one line
naming both numbers, read from the safetensors headers (no tensor data), before any rank starts.

    python -m pytest -q tests/faults/test_vocab_mismatch.py
"""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.launcher.preflight import check_model_paths
from megarl.launcher.preflight_weights import check_vocab_size

QUICKSTART = "configs/quickstart.yaml"      # lengths that fit the addition model's positions


def _copy(src, dst, vocab: int | None = None):
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    if vocab is not None:
        hf["vocab_size"] = vocab
        (dst / "config.json").write_text(json.dumps(hf))
    return hf


def test_a_config_vocab_that_disagrees_with_the_embedding_is_one_line(tmp_path, addition_model_dir):
    real = _copy(addition_model_dir, tmp_path / "real")["vocab_size"]
    model = tmp_path / "m"
    _copy(addition_model_dir, model, vocab=real + 100)
    cfg = load_config(QUICKSTART, [f"actor_rollout_ref.model.path={model}"])
    with pytest.raises(ConfigError) as err:
        check_model_paths(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith("actor_rollout_ref.model.path: ")
    assert f"says vocab_size {real + 100}" in line and f"({real} rows)" in line
    assert "holds lm_head.weight of shape" in line or "holds model.embed_tokens.weight of shape" in line
    check_model_paths(load_config(QUICKSTART, [f"actor_rollout_ref.model.path={tmp_path / 'real'}"]))   # the control


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path, addition_model_dir):
    model = tmp_path / "sharded"
    hf = _copy(addition_model_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    head = {k: v for k, v in tensors.items() if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    rest = {k: v for k, v in tensors.items() if k not in head}
    save_file(rest, str(model / "model-00001-of-00002.safetensors"))
    save_file(head, str(model / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in rest},
                  **{k: "model-00002-of-00002.safetensors" for k in head}}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    check_vocab_size(hf, str(model))
    with pytest.raises(ConfigError, match=rf"says vocab_size 7, but model-00002-of-00002.safetensors holds .* "
                                          rf"\({hf['vocab_size']} rows\)"):
        check_vocab_size({**hf, "vocab_size": 7}, str(model))


def test_no_vocab_size_or_no_vocab_tensor_is_left_to_the_other_checks(tmp_path):
    save_file({"model.norm.weight": __import__("numpy").ones(4, dtype="float32")}, str(tmp_path / "model.safetensors"))
    check_vocab_size({"vocab_size": 9}, str(tmp_path))
    check_vocab_size({}, str(tmp_path))
