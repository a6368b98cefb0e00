"""The shipped GPU configs through `--check` against the published config.json of the models users
train with them (tests/assets/models/: Qwen2.5-7B-Instruct, Qwen3-30B-A3B), and the refusal of a
large model on CPU.

    python -m pytest -q tests/test_configs_7b.py

Each model directory holds the real config.json, a small tokenizer with a chat template, and one
safetensors file whose header names every tensor at its real shape over a sparse body (no bytes
are written: the preflight reads headers only). This machine has no GPU and no TensorRT-LLM, so the
run asks for the built-in engine on CPU, which the large-model rule then refuses unless
trainer.allow_large_model_on_cpu says it is meant.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megarl.experiment import load_config
from megarl.models.spec import ModelSpec
from tests.helpers.real_models import ASSETS, CHATML, ROOT, check_config, sparse_safetensors

GPU_CONFIGS = ["grpo_gsm8k_qwen2.5_7b.yaml", "ppo_gsm8k_qwen2.5_7b.yaml"]
MODELS = {"qwen2.5-7b-instruct": 7.6, "qwen3-30b-a3b": 30.5}      # billions of parameters
# The largest rollout TP of one 8-GPU node: both models have 4 KV heads; 30B-A3B's 32 query heads take
# TP 8 (two ranks per KV head, replicated); 8 does not divide 7B's 28, so a node runs it at TP 4.
ROLLOUT_TP = {"qwen2.5-7b-instruct": 4, "qwen3-30b-a3b": 8}
# Where the machine has neither, the engine and the device are the two things --check cannot judge here.
ON_CPU = ["actor_rollout_ref.rollout.name=native", "trainer.device=cpu", "trainer.logger=[console]"]
# A 30B checkpoint wants ~230 GB free beside the run, which a cluster's project storage has and this
# machine's disk may not: the test saves nothing.
NO_SAVES = "trainer.save_freq=-1"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tests.rollout.fixtures import save_tokenizer
    out = {}
    for name in MODELS:
        d = tmp_path_factory.mktemp(name)
        shutil.copy(os.path.join(ASSETS, name, "config.json"), d / "config.json")
        tok = save_tokenizer(str(d), size=json.loads((d / "config.json").read_text())["vocab_size"])
        tok.chat_template = CHATML
        tok.save_pretrained(str(d))
        sparse_safetensors(str(d / "model.safetensors"), json.loads((d / "config.json").read_text()))
        out[name] = str(d)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megarl.examples.verl_gsm8k import write
    d = tmp_path_factory.mktemp("gsm8k")
    write(str(d), train=300, test=8)                       # the configs' train_batch_size is 256
    return str(d)


@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_gpu_configs_ask_for_cuda(config):
    assert load_config(os.path.join(ROOT, "configs", config)).trainer.device == "cuda"


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_shipped_config_checks_out_on_the_real_model(config, model, model_dirs, data_dir, monkeypatch, capsys,
                                                     tmp_path):
    code, out, err = check_config(config, model_dirs[model], data_dir, monkeypatch, capsys, *ON_CPU,
                            "trainer.allow_large_model_on_cpu=true", NO_SAVES,
                            f"trainer.default_local_dir={tmp_path}/run",
                            f"actor_rollout_ref.rollout.tensor_model_parallel_size={ROLLOUT_TP[model]}")
    assert code == 0, err
    assert "config and inputs check out" in out


@pytest.mark.parametrize("model", list(MODELS))
def test_large_model_on_cpu_is_refused_in_one_line(model, model_dirs, data_dir, monkeypatch, capsys):
    code, _, err = check_config(GPU_CONFIGS[0], model_dirs[model], data_dir, monkeypatch, capsys, *ON_CPU)
    assert code == 2 and err.count("\n") == 1, err
    billions = f"{MODELS[model]:.1f}B parameters"
    assert f"trainer.device: is cpu, and the model has {billions}" in err
    assert "trainer.allow_large_model_on_cpu=true" in err and "trainer.device=cuda" in err
    if not __import__("torch").cuda.is_available():    # auto without a GPU is CPU too
        code, _, err = check_config(GPU_CONFIGS[0], model_dirs[model], data_dir, monkeypatch, capsys, *ON_CPU,
                              "trainer.device=auto")
        assert code == 2 and "is auto and this machine has no usable GPU" in err, err


def test_small_model_on_cpu_needs_no_permission():
    from megarl.workers.config_checks import CPU_MAX_PARAMS, check_model_on_cpu
    from tests.rollout.fixtures import tiny_config
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"))
    tiny = tiny_config().to_dict()
    assert ModelSpec.from_hf_config(tiny).num_parameters() < CPU_MAX_PARAMS
    check_model_on_cpu(cfg, tiny)                           # no error
    big = json.load(open(os.path.join(ASSETS, "qwen2.5-7b-instruct", "config.json")))
    with pytest.raises(Exception, match="7.6B parameters"):
        check_model_on_cpu(cfg, big)
