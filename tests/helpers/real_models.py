"""The shipped GPU configs' inputs as tests build them: a model directory with a published
config.json and a safetensors header at the real shapes over a sparse body, and `--check` run in
process on a shipped config (tests/test_configs_7b.py, tests/test_memory_plan.py)."""
from __future__ import annotations

import json
import os
import struct

import pytest

import megarl.train as train_mod
from megarl.models.convert import hf_shapes
from megarl.models.spec import ModelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "tests", "assets", "models")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SEVEN_B_CONFIG = "grpo_gsm8k_qwen2.5_7b.yaml"      # the shipped 7B config, and the model it names
SEVEN_B = "qwen2.5-7b-instruct"


def seven_b() -> dict:
    """Qwen2.5-7B-Instruct's config.json, as shipped in the test data."""
    with open(os.path.join(ASSETS, SEVEN_B, "config.json")) as f:
        return json.load(f)


def sparse_safetensors(path: str, hf_config: dict) -> None:
    """model.safetensors with every tensor megarl reads, bf16 at its real shape; the body is a hole."""
    header, offset = {}, 0
    for name, shape in hf_shapes(ModelSpec.from_hf_config(hf_config), "lm").items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)


def check_config(config: str, model: str, data: str, monkeypatch, capsys, *overrides: str) -> tuple[int, str, str]:
    monkeypatch.setenv("MODEL", model)
    monkeypatch.setenv("DATA", data)
    monkeypatch.setattr(train_mod, "spawn_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    code = train_mod.main(["--config", os.path.join(ROOT, "configs", config), "--check", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err
