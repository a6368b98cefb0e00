"""`--check` refuses what the ranks would refuse after the queue: a model directory without weight
files, and a tokenizer far smaller than the model's vocab_size (one from another model, or none:
transformers builds a 1-token tokenizer from config.json alone). One line each, naming both sizes.

    python -m pytest -q tests/test_check_model_files.py
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.launcher.preflight import check_model_paths, check_with_tokenizer
from megarl.launcher.preflight_weights import check_tokenizer_size

QUICKSTART = "configs/quickstart.yaml"
SEVEN_B = os.path.join(os.path.dirname(__file__), "assets", "models", "qwen2.5-7b-instruct")   # vocab_size 152064
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


def one_line(err) -> str:
    line = str(err.value)
    assert "\n" not in line, line
    return line


def test_a_model_directory_without_weights_is_refused(tmp_path, addition_model_dir):
    model = tmp_path / "m"
    shutil.copytree(addition_model_dir, model)
    os.remove(model / "model.safetensors")
    with pytest.raises(ConfigError) as err:
        check_model_paths(load_config(QUICKSTART, [f"actor_rollout_ref.model.path={model}"]))
    line = one_line(err)
    assert line.startswith(f"actor_rollout_ref.model.path: {model} holds config.json but no weights "
                           "(no *.safetensors file)"), line
    assert f"hf download <repo id> --local-dir {model}" in line


def test_a_model_without_tokenizer_files_is_refused_naming_both_sizes(tmp_path, addition_model_dir):
    model = tmp_path / "m"
    shutil.copytree(addition_model_dir, model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    cfg = load_config(QUICKSTART, [f"actor_rollout_ref.model.path={model}"])
    check_with_tokenizer(cfg)                        # the control: the model's own tokenizer
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            os.remove(model / name)
    check_model_paths(cfg)                           # weights and config are fine
    with pytest.raises(ConfigError) as err:
        check_with_tokenizer(cfg)                    # transformers' tokenizer from config.json alone
    line = one_line(err)
    assert line.startswith(f"actor_rollout_ref.model.tokenizer_path: the tokenizer in {model} has 1 tokens, but "
                           f"the model's vocab_size is {vocab}"), line
    assert "so transformers built a tokenizer from config.json alone" in line


def test_padding_passes_and_another_models_tokenizer_does_not(tmp_path):
    # Qwen2.5-7B's published config: 152064 rows for its tokenizer's 151665 tokens (399 of padding)
    check_tokenizer_size(151665, SEVEN_B, str(tmp_path))
    check_tokenizer_size(152064, SEVEN_B, str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        check_tokenizer_size(128256, SEVEN_B, str(tmp_path))       # Llama 3's tokenizer
    line = one_line(err)
    assert "has 128256 tokens, but the model's vocab_size is 152064" in line
    assert "it is not this model's tokenizer" in line
