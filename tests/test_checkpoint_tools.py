"""checkpoints_tools/ as users run them (subprocesses, real gloo ranks, transformers as the oracle):
HF -> megatron (TP2 x PP2) -> HF is bit-exact and loads in transformers; verify.py reports parity
on its last line; bad input stops with one line before any rank starts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.helpers.megatron_roles import assert_same_tensors


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return {
        # bf16 weights, tied embeddings, GQA, vocab 301: the round trip must keep all of it exactly.
        "llama": make_tiny_hf(str(root / "llama"), "llama", seed=4, vocab_size=301, tie_word_embeddings=True,
                              dtype=torch.bfloat16),
        "qwen2": make_tiny_hf(str(root / "qwen2"), "qwen2", seed=5, vocab_size=301),
        "root": str(root),
    }


@pytest.mark.timeout(600)
def test_hf_megatron_hf_round_trip_is_bit_exact(models):
    src, ckpt, back = models["llama"], os.path.join(models["root"], "ckpt"), os.path.join(models["root"], "back")
    got = run("checkpoints_tools/hf_to_megatron.py", "--hf", src, "--out", ckpt, "--tp", "2", "--pp", "2")
    assert got.returncode == 0, got.stderr[-3000:]
    got = run("checkpoints_tools/megatron_to_hf.py", "--ckpt", ckpt, "--out", back, "--trust-unsealed-checkpoint")
    assert got.returncode == 0, got.stderr[-3000:]
    assert_same_tensors(src, back)
    assert os.path.isfile(os.path.join(back, "tokenizer.json"))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    a = AutoModelForCausalLM.from_pretrained(src)
    b = AutoModelForCausalLM.from_pretrained(back)
    ids = AutoTokenizer.from_pretrained(back)("w1 w2 w3 w40", return_tensors="pt").input_ids
    assert torch.equal(a(ids).logits, b(ids).logits)
    # Inside a step megarl sealed, a .metadata changed after the save is refused before torch unpickles it.
    from megarl.trainer.checkpoints import verified_io
    step = os.path.join(models["root"], "run", "global_step_1")
    shutil.copytree(ckpt, os.path.join(step, "actor"))
    os.chmod(os.path.dirname(step), 0o700)
    verified_io.seal(step)
    # Under a parent any user may write, the tool reads the step through its directory held open, saying so.
    # (The exports go where only this user can write: an export directory is checked as a run directory is.)
    os.chmod(models["root"], 0o777)
    back = os.path.join(os.path.dirname(models["root"]), "tools-back")
    got = run("checkpoints_tools/megatron_to_hf.py", "--ckpt", os.path.join(step, "actor"), "--out", back + "1")
    assert got.returncode == 0 and "but the step is read only through the directory checked, held open" in \
        got.stdout, got.stdout + got.stderr[-3000:]
    assert_same_tensors(src, back + "1")
    with open(os.path.join(step, "actor", ".metadata"), "ab") as f:
        f.write(b"\x80")
    got = run("checkpoints_tools/megatron_to_hf.py", "--ckpt", os.path.join(step, "actor"), "--out", back + "2")
    last = got.stderr.strip().splitlines()[-1]
    assert got.returncode == 2 and last.startswith(f"megatron_to_hf: refused {step}: actor/.metadata has "), \
        got.stderr[-3000:]
    assert not os.path.exists(back + "2")


@pytest.mark.timeout(600)
def test_verify_reports_parity_on_its_last_line(models):
    got = run("checkpoints_tools/verify.py", "--hf", models["qwen2"], "--tp", "2", "--pp", "1")
    assert got.returncode == 0, got.stderr[-3000:]
    last = got.stdout.strip().splitlines()[-1]
    assert last.startswith("max abs diff: ") and float(last.split(": ")[1]) < 1e-4, last
    from checkpoints_tools.verify import compare
    assert compare(torch.zeros(2), torch.full((2,), 1e-3), 1e-4) == (pytest.approx(1e-3), 1)


def test_tools_refuse_bad_input_in_one_line(models, tmp_path):
    got = run("checkpoints_tools/verify.py", "--hf", models["qwen2"], "--tp", "4")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1] == ("verify: TP=4 must divide num_key_value_heads=2 (each TP rank "
                                                   "holds whole KV groups; KV-head replication is not supported): "
                                                   "pick a TP that divides 2")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (bad / "model.safetensors").write_bytes(b"")
    got = run("checkpoints_tools/hf_to_megatron.py", "--hf", str(bad), "--out", str(tmp_path / "out"))
    assert got.returncode == 2
    assert "unsupported architecture GPT2LMHeadModel" in got.stderr.strip().splitlines()[-1]
