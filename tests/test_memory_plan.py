"""`megarl-train --check` on a machine without a GPU (a login node), and its memory plan, through the
shipped Qwen2.5-7B config against the model's published config.json (tests/test_configs_7b.py's
model directories: real config.json, sparse safetensors).

    python -m pytest -q tests/test_memory_plan.py
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megarl.experiment import load_config
from megarl.launcher.memory_plan import DEVICE_MEMORY_ENV, memory_plan
from megarl.launcher.memory_terms import Layout, activation_bytes
from megarl.models.spec import ModelSpec
from tests.helpers.real_models import ASSETS, CHATML, ROOT, check_config, sparse_safetensors

CONFIG = "grpo_gsm8k_qwen2.5_7b.yaml"
SEVEN_B = "qwen2.5-7b-instruct"
LOGIN_NODE = not torch.cuda.is_available() and importlib.util.find_spec("tensorrt_llm") is None
# the shipped config as a login node sees it: its own device (cuda) and engine (trtllm), no GPU
AS_SHIPPED = ["trainer.logger=[console]", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[str, str]:
    """(model directory, data directory) as tests/test_configs_7b.py builds them, for the 7B only."""
    from megarl.examples.verl_gsm8k import write
    from tests.rollout.fixtures import save_tokenizer
    model = tmp_path_factory.mktemp(SEVEN_B)
    (model / "config.json").write_text(json.dumps(_seven_b()))
    tok = save_tokenizer(str(model), size=_seven_b()["vocab_size"])
    tok.chat_template = CHATML
    tok.save_pretrained(str(model))
    sparse_safetensors(str(model / "model.safetensors"), _seven_b())
    data = tmp_path_factory.mktemp("gsm8k")
    write(str(data), train=300, test=8)                    # the config's train_batch_size is 256
    return str(model), str(data)


def _run(inputs, monkeypatch, capsys, tmp_path, *overrides):
    # no saves: a 7B checkpoint (~100 GiB) is more than this machine's disk, which the free-space check refuses
    return check_config(CONFIG, inputs[0], inputs[1], monkeypatch, capsys, *AS_SHIPPED, "trainer.save_freq=-1",
                  f"trainer.default_local_dir={tmp_path}/run", *overrides)


@pytest.mark.skipif(not LOGIN_NODE, reason="a machine without a GPU and without TensorRT-LLM")
def test_login_node_checks_the_rest_and_lists_what_it_could_not(inputs, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(DEVICE_MEMORY_ENV, raising=False)
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    unchecked = [ln for ln in lines if ln.startswith("megarl: not checked here: ")]
    assert len(unchecked) == 2, out
    assert any("'tensorrt_llm' package is not installed" in ln for ln in unchecked)
    assert any("the GPU: this machine has none" in ln for ln in unchecked)
    assert "memory plan per rank" in out and f"no fit verdict: this machine has no GPU; {DEVICE_MEMORY_ENV}" in out
    assert lines[-1].startswith("megarl: config and inputs check out")
    # a real problem is still an error on a login node: exit code 2, one line
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path, "data.prompt_key=question_text")
    assert code == 2 and err.count("\n") == 1 and "question_text" in err, err


@pytest.mark.skipif(not LOGIN_NODE, reason="a machine without a GPU and without TensorRT-LLM")
def test_device_memory_from_the_environment_gives_the_verdict(inputs, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "80")
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path)
    assert code == 0, err
    assert "device: 80 GiB from MEGARL_DEVICE_MEMORY_GB" in out and ": fits, " in out, out
    # TP 1 without the distributed optimizer: 7.6B x (2 + 4 + 12) bytes cannot fit 80 GiB
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path,
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                          "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false")
    assert code == 2 and err.count("\n") == 1, err
    assert "the largest term is actor optimizer (85.1 GiB)" in err and "use_distributed_optimizer" in err, err
    # everything the trainer keeps on the device plus the engine's weights leave no KV cache
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path,
                          "actor_rollout_ref.rollout.gpu_memory_utilization=0.3")
    assert code == 2 and "KV cache" in err and "gpu_memory_utilization" in err, err
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "eighty")
    code, out, err = _run(inputs, monkeypatch, capsys, tmp_path)
    assert code == 2 and "MEGARL_DEVICE_MEMORY_GB='eighty' is not a number" in err, err


def _seven_b() -> dict:
    with open(os.path.join(ASSETS, SEVEN_B, "config.json")) as f:
        return json.load(f)


def test_static_bytes_of_the_7b_layout_by_hand(monkeypatch):
    """Qwen2.5-7B at TP 4, DP 2: every tensor split over TP but the norms (2 per layer + the final
    one, 3584 wide, replicated), bf16 weights, fp32 grads, Adam's 12 bytes over half the ranks."""
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "80")
    cfg = load_config(os.path.join(ROOT, "configs", CONFIG), [f"actor_rollout_ref.model.path={ASSETS}/{SEVEN_B}",
                                                              "actor_rollout_ref.rollout.tensor_model_parallel_size=4"])
    plan = memory_plan(cfg, _seven_b())
    actor = next(r for r in plan.rows if r.role == "actor")
    norms = (28 * 2 + 1) * 3584
    per_rank = (7_615_616_512 - norms) // 4 + norms              # the published parameter count
    slack = 64 * 400 + 128                                       # alignment of ~340 tensors, the bucket's end
    assert 0 <= actor.static.params - 2 * per_rank <= 2 * slack
    assert 0 <= actor.static.grads - 4 * per_rank <= 4 * slack
    assert abs(actor.static.optimizer - 12 * per_rank // 2) <= 12 * slack
    assert plan.engine_weights == 7_615_616_512 * 2 // 4
    ref = next(r for r in plan.rows if r.role == "ref")          # frozen: its weights only, unpadded
    assert ref.static.params == 2 * per_rank and ref.static.grads == ref.static.optimizer == 0
    assert plan.kv_token_bytes == 2 * 28 * 1 * 128 * 2          # 4 KV heads over rollout TP 4


def test_activation_bytes_by_hand():
    spec = ModelSpec.from_hf_config(_seven_b())
    h, kvd, f, s = 3584, 4 * 128, 18944, 4096
    per_layer = 8 * h + 2 * (h + 2 * kvd) + 2 * h + 6 * f       # bytes per token, bf16 (memory_terms)
    assert activation_bytes(spec, Layout(), s, 8) == s * per_layer * 28
    assert activation_bytes(spec, Layout(tp=4, sequence_parallel=True), s, 8) == s * per_layer * 28 // 4
    tp_no_sp = s * (8 * h + (per_layer - 8 * h) / 4) * 28
    assert activation_bytes(spec, Layout(tp=4), s, 8) == int(tp_no_sp)
    # full recompute: each layer's input, and one layer's full set while it is recomputed
    assert activation_bytes(spec, Layout(recompute="full"), s, 8) == s * 2 * h * 28 + s * per_layer
    # 1F1B: stage 0 of 2 holds half the layers for 2 micro-batches in flight
    assert activation_bytes(spec, Layout(pp=2), s, 8) == s * per_layer * 14 * 2


# -- the plan against what benchmarks/gpu_update_step.py measures (benchmarks/gpu_check.py's report) ------
def _benchmark_config(shape: str) -> dict:
    import transformers
    from benchmarks.gpu_update_step import SHAPES
    cfg = transformers.AutoConfig.for_model("qwen2", **SHAPES[shape], tie_word_embeddings=False).to_dict()
    return {**cfg, "architectures": ["Qwen2ForCausalLM"]}


def test_plan_against_given_gpu_numbers():
    """The 0.86b shape as gpu_check runs it on a GPU (bf16, distributed optimizer, DP 1): the static
    part is 2 + 4 + 12 bytes a parameter plus megatron's alignment; a measured figure off by one MiB is
    flagged, a peak within the tolerance of static + activations is not."""
    from benchmarks.plan_vs_measured import PEAK_TOLERANCE, compare, planned
    hf = _benchmark_config("0.86b")
    result = {"device": "cuda:0", "dtype": "bfloat16", "distributed_optimizer": True, "recompute": False,
              "batch": [32, 256, 768], "micro": 8}
    plan = planned(hf, result)
    n = ModelSpec.from_hf_config(hf).num_parameters()
    assert 18 * n <= plan["static"] <= 18 * (n + 64 * 200 + 128)
    gib = 2**30
    exact = {**result, "offload": {"resident_gb_before": plan["static"] / gib},
             "memory": {"memory/update_actor_peak_gb": plan["update_actor peak"] * 1.1 / gib}}
    rows = compare(hf, exact)
    assert [(r["phase"], r["ok"]) for r in rows] == [("static", True), ("update_actor peak", True)]
    off = {**exact, "offload": {"resident_gb_before": (plan["static"] + 2**20) / gib},
           "memory": {"memory/update_actor_peak_gb": plan["update_actor peak"] * (1.01 + PEAK_TOLERANCE) / gib}}
    assert [r["ok"] for r in compare(hf, off)] == [False, False]


def test_plan_matches_the_benchmark_on_cpu(tmp_path):
    """gpu_update_step's own run on CPU (its --smoke shape, fp32, megarl's CPU optimizer): the bytes it
    measures before offload are the plan's, to the byte. The peak row needs CUDA's allocator."""
    from benchmarks.gpu_update_step import run
    from benchmarks.plan_vs_measured import compare
    result = run(["--smoke", "--micro", "2", "--model-dir", str(tmp_path / "m"), "--json", os.devnull])
    with open(tmp_path / "m" / "config.json") as f:
        rows = compare(json.load(f), result)
    assert [(r["phase"], r["ok"]) for r in rows] == [("static", True)], rows


def test_the_critic_is_the_actor_without_its_lm_head(monkeypatch):
    """The shipped PPO config: the critic (the actor's backbone, a one-row value head) holds the
    actor's bytes less the LM head's vocabulary rows on this TP rank, for each static part."""
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "80")
    cfg = load_config(os.path.join(ROOT, "configs", "ppo_gsm8k_qwen2.5_7b.yaml"),
                      [f"actor_rollout_ref.model.path={ASSETS}/{SEVEN_B}",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=4"])
    plan = memory_plan(cfg, _seven_b())
    rows = {r.role: r for r in plan.rows}
    assert set(rows) == {"actor", "critic"}                       # no KL term: no reference
    head = 152064 // 4 * 3584 - 3584                              # lm_head's rows here, less the value head
    a, c = rows["actor"].static, rows["critic"].static
    assert abs((a.params - c.params) - 2 * head) <= 2 * 256 and abs((a.grads - c.grads) - 4 * head) <= 4 * 256
    assert rows["critic"].activations == rows["actor"].activations   # same layer stack, same micro-batches


def test_lora_plans_the_frozen_base_and_says_what_it_leaves_out(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "80")
    cfg = load_config(os.path.join(ROOT, "configs", CONFIG), [f"actor_rollout_ref.model.path={ASSETS}/{SEVEN_B}",
                                                              "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                                                              "actor_rollout_ref.model.lora_rank=8",
                                                              "actor_rollout_ref.ref.param_offload=false"])
    plan = memory_plan(cfg, _seven_b())
    assert [r.role for r in plan.rows] == ["actor"]              # the reference is LoRA's base: no model of its own
    actor = plan.rows[0]
    assert actor.static.grads == actor.static.optimizer == 0 and actor.static.params > 0
    assert "lora: the base's weights; what it adds is not planned" in actor.note
