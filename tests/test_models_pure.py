"""Single-process checks of megarl/models and the pure parts of megarl/workers: config -> spec,
refusals, the HF <-> megatron maps at several TP sizes, log-prob math, batching, LR schedule."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.config import ConfigError
from megarl.experiment import build_config
from megarl.models.convert import (EMBED, OUTPUT, checkpoint_to_hf, hf_shapes, hf_slices, hf_to_megatron,
                                   megatron_names, megatron_to_hf, rank_plan, shard_shape, to_global, to_local,
                                   tp_dim)
from megarl.models import families
from megarl.models.families.base import ModelFamily
from megarl.models.families.qwen3 import QK_NORM
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.models.spec import ModelSpec, check_layout, layer_offset
from megarl.models.tiny import make_tiny_hf
from tests.helpers.megatron_roles import make_batch
from megarl.workers import batching
from megarl.workers.config import OptimConfig
from megarl.workers.preflight import EngineSpec, read_spec, resolve_dtype
from megarl.workers.logprob import token_log_probs
from megarl.workers.optim import lr_at

QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 301, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}, "tie_word_embeddings": False}
LLAMA = {**QWEN, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 1,
         "head_dim": 24, "tie_word_embeddings": True, "rope_theta": 20000.0}
LLAMA.pop("rope_parameters")


def random_hf(spec: ModelSpec, head: str = "lm", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shapes(spec, head).items()}


# -- spec ------------------------------------------------------------------------------------------------
def test_spec_reads_both_families_and_rope_forms():
    q = ModelSpec.from_hf_config(QWEN)
    assert (q.family, q.qkv_bias, q.rope_theta, q.head_dim, q.tie_word_embeddings) == ("qwen2", True, 5000.0, 16, False)
    ll = ModelSpec.from_hf_config(LLAMA)
    assert (ll.family, ll.qkv_bias, ll.rope_theta, ll.head_dim, ll.num_kv_heads) == ("llama", False, 20000.0, 24, 1)
    assert ll.qkv_rows == 1 * (4 + 2) * 24
    assert q.padded_vocab(1) == q.padded_vocab(2) == q.padded_vocab(4) == 384  # TP-independent padding
    assert q.padded_vocab(3) % 3 == 0 and q.padded_vocab(3) >= 301
    scaled = ModelSpec.from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})
    assert scaled.rope_scaling_factor == 32.0


@pytest.mark.parametrize("cfg, words", [
    ({**QWEN, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture GPT2LMHeadModel"),
    ({**LLAMA, "attention_bias": True}, "attention_bias"),
    ({**QWEN, "use_sliding_window": True}, "use_sliding_window"),
    ({**QWEN, "hidden_act": "gelu"}, "hidden_act"),
    ({**QWEN, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({**QWEN, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
])
def test_spec_refuses_unsupported_models_in_one_line(cfg, words):
    with pytest.raises(ValueError) as err:
        ModelSpec.from_hf_config(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_families_register_once_and_claim_their_configs():
    fam, arch, head = families.for_config({"architectures": ["Qwen3ForSequenceClassification"]})
    assert (fam.name, arch, head, fam.hooks) == ("qwen3", "Qwen3ForSequenceClassification", "score", QK_NORM)
    assert families.for_config({"model_type": "mistral"})[1] == "MistralForCausalLM"   # no `architectures`
    assert ModelSpec.from_hf_config(QWEN).model_family is families.get("qwen2")
    for clash in (ModelFamily(name="qwen2", model_type="x", architectures={"XForCausalLM": "lm"}),
                  ModelFamily(name="x", model_type="x", architectures={"LlamaForCausalLM": "lm"})):
        with pytest.raises(ValueError, match="already registered"):
            families.register(clash)
    assert "x" not in families.names()


def test_a_family_file_is_a_family(tmp_path, monkeypatch):
    """megarl's families are found by their file names (no list to edit); a module of a family that
    does not register what it is declared to is named at the first read."""
    from megarl.config.registry import Registry, package_modules
    assert set(package_modules("megarl.models.families")) - {"base", "hooks", "registry"} == set(families.names())
    pkg = tmp_path / "demo_families"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "demo.py").write_text("from megarl.models.families.base import ModelFamily, causal_and_score\n"
                                 "FAMILY = ModelFamily(name='demo', model_type='demo', "
                                 "architectures=causal_and_score('Demo'))\n")
    (pkg / "quiet.py").write_text("def FAMILY():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = Registry("model family", "x", {n: f"{m}:FAMILY" for n, m in package_modules("demo_families").items()})
    assert found.names() == ["demo", "quiet"] and found.get("demo").architectures["DemoForCausalLM"] == "lm"
    with pytest.raises(RuntimeError, match="demo_families.quiet is declared to register model family 'quiet'"):
        found.get("quiet")


def test_layout_rules_name_the_rule():
    spec = ModelSpec.from_hf_config(QWEN)
    check_layout(spec, 2, 4)
    for tp, pp, words in ((4, 1, "TP=4 must divide num_key_value_heads=2"),
                          (1, 3, "PP=3 must divide num_hidden_layers=4")):
        with pytest.raises(ValueError, match=words):
            check_layout(spec, tp, pp)
    assert [layer_offset(spec, r, 2) for r in range(2)] == [0, 2]


# -- conversion --------------------------------------------------------------------------------------------
LLAMA_GQA = {**LLAMA, "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg, head, tp", [(QWEN, "lm", 1), (QWEN, "lm", 2), (QWEN, "value", 2), (LLAMA, "lm", 1),
                                           (LLAMA_GQA, "lm", 2)])
def test_hf_to_megatron_and_back_is_exact(cfg, head, tp):
    spec = ModelSpec.from_hf_config(cfg)
    hf = random_hf(spec, head)
    names = megatron_names(spec, range(spec.num_layers), True, True, head)
    back = {}
    for name in names:
        shards = [hf_to_megatron(name, hf, spec, r, tp, head) for r in range(tp)]
        for r, s in enumerate(shards):
            assert tuple(s.shape) == shard_shape(name, spec, tp, head)
        back.update(dict(megatron_to_hf(name, shards, spec, head)))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    # The stored-checkpoint form (layers stacked, TP shards concatenated) maps back too.
    stacked = {}
    for name in names:
        shards = [hf_to_megatron(name, hf, spec, r, tp, head) for r in range(tp)]
        full = shards[0] if tp_dim(name, head) is None else torch.cat(shards, tp_dim(name, head))
        if name.startswith("decoder.layers."):
            suffix = name.split(".", 3)[3]
            suffix = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                      "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(suffix, suffix)
            if "linear_fc1.weight" in name and tp > 1:  # megatron stores [gate_all; up_all]
                parts = [hf_to_megatron(name, hf, spec, r, tp, head).chunk(2) for r in range(tp)]
                full = torch.cat([p[0] for p in parts] + [p[1] for p in parts])
            stacked.setdefault("decoder.layers." + suffix, []).append(full)
        else:
            stacked[name] = [full]
    plain = {k: torch.stack(v) if k.startswith("decoder.layers.") else v[0] for k, v in stacked.items()}
    again = dict(checkpoint_to_hf(plain, spec, head))
    assert all(torch.equal(again[n], hf[n]) for n in hf)


def test_fused_layouts_follow_megatron_conventions():
    spec = ModelSpec.from_hf_config(QWEN)  # 4 query heads, 2 KV groups, head_dim 16
    hf = random_hf(spec)
    qkv = hf_to_megatron("decoder.layers.1.self_attention.linear_qkv.weight", hf, spec, 1, 2)
    # TP rank 1 holds KV group 1: query heads 2,3 then its k and v head.
    q, k, v = (hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(qkv, torch.cat([q[32:64], k[16:32], v[16:32]]))
    fc1 = hf_to_megatron("decoder.layers.0.mlp.linear_fc1.weight", hf, spec, 1, 2)
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"][48:],
                                       hf["model.layers.0.mlp.up_proj.weight"][48:]]))
    emb = hf_to_megatron(EMBED, hf, spec, 1, 2)  # rows 192..383: 109 real, then zero padding
    assert torch.equal(emb[:109], hf["model.embed_tokens.weight"][192:]) and not emb[109:].any()


def test_rank_plan_reads_only_owned_slices():
    spec = ModelSpec.from_hf_config(QWEN)
    plan = rank_plan(spec, tp_rank=1, tp=2, pp_rank=1, pp=2)
    assert EMBED not in plan and OUTPUT in plan and "decoder.layers.2.input_layernorm.weight" in plan
    assert "decoder.layers.1.input_layernorm.weight" not in plan
    q, k, v = plan["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert (q.dim, q.start, q.stop, k.start, k.stop) == (0, 32, 64, 16, 32)
    (proj,) = plan["decoder.layers.3.self_attention.linear_proj.weight"]
    assert (proj.dim, proj.start, proj.stop) == (1, 32, 64)
    assert to_global("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert to_local("decoder.layers.3.mlp.linear_fc2.weight", 2) == "decoder.layers.1.mlp.linear_fc2.weight"
    tied = ModelSpec.from_hf_config(LLAMA)
    assert OUTPUT not in megatron_names(tied, range(4), True, True)  # single stage: reads the embedding
    assert hf_slices(OUTPUT, tied, 0, 1)[0].hf_name == "model.embed_tokens.weight"
    assert megatron_to_hf(OUTPUT, [torch.zeros(384, 64)], tied) == []


# -- checkpoint reading and refusals before any allocation --------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("tiny") / "qwen2"), "qwen2")


def _copy_with(src: str, dst: str, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    tensors, cfg = edit(tensors, cfg)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_checkpoints_are_refused_before_allocation(tiny, tmp_path):
    read_spec(EngineSpec(tiny, tp=2, pp=2))  # the good one passes
    cases = {
        "missing": (lambda t, c: ({k: v for k, v in t.items() if "layers.2.mlp.up_proj" not in k}, c),
                    "tensor model.layers.2.mlp.up_proj.weight is missing"),
        "shape": (lambda t, c: ({**t, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}, c),
                  "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]"),
        "arch": (lambda t, c: (t, {**c, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}),
                 "unsupported architecture MixtralForCausalLM"),
    }
    for name, (edit, words) in cases.items():
        path = _copy_with(tiny, str(tmp_path / name), edit)
        with pytest.raises(ValueError) as err:
            read_spec(EngineSpec(path, tp=1, pp=1))
        assert words in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="TP=4 must divide num_key_value_heads=2"):
        read_spec(EngineSpec(tiny, tp=4, pp=1))
    with pytest.raises(ValueError, match="PP=3 must divide num_hidden_layers=4"):
        read_spec(EngineSpec(tiny, tp=1, pp=3))
    with pytest.raises(ValueError, match="needs a `score` head.*use critic.model.init_from=actor"):
        read_spec(EngineSpec(tiny, head="value", head_from_checkpoint=True, role="critic"))
    with pytest.raises(ValueError, match="reward_model needs a `score` head.*give reward_model.model.path a reward"):
        read_spec(EngineSpec(tiny, head="value", head_from_checkpoint=True, role="reward_model"))
    assert resolve_dtype("auto", True) == torch.float32  # this machine has no CUDA
    with pytest.raises(ConfigError, match="dtype=bfloat16 needs CUDA"):
        resolve_dtype("bfloat16", True)


def test_sliced_reads_match_full_tensors(tiny):
    ckpt = HFCheckpoint(tiny)
    spec = ckpt.spec()
    ckpt.validate(spec)
    for name, slices in rank_plan(spec, 1, 2, 0, 2).items():
        for s in slices:
            full = ckpt.read_full(s.hf_name)
            assert torch.equal(ckpt.read(s), s.take(full)), s


# -- worker math -----------------------------------------------------------------------------------------------
def test_token_log_probs_drop_padding_and_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g)
    logits[..., 37:] = 50.0  # padding rows past the real vocabulary must not count
    targets = torch.randint(0, 37, (3, 5), generator=g)
    lp, ent = token_log_probs(logits, targets, 0, 37)
    ref = logits[..., :37].log_softmax(-1)
    assert torch.allclose(lp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_batch_checks_and_positions():
    # prompts of 1-5 tokens, responses of 0-5 (empty ones included)
    data = make_batch(50, B=4, R=5, prompts=(1, 6), min_response=0, pad=3, targets=False)
    batching.check_batch(data, need_mask=True)
    pos = batching.response_positions(data.batch["prompt_lens"], 5, data.batch["input_ids"].shape[1])
    assert torch.equal(pos[:, 0], data.batch["prompt_lens"] - 1)
    bad = data.clone()
    bad.batch["responses"][0, 0] += 1
    bad.batch["response_lens"][0] = 5
    with pytest.raises(ValueError, match="row 0: responses differ from input_ids"):
        batching.check_batch(bad)
    with pytest.raises(ValueError, match="batch has no 'response_mask'"):
        batching.check_batch(data.select(["input_ids", "prompt_lens", "response_lens", "responses"]), need_mask=True)
    padded, n = batching.pad_rows(data, 3)
    assert (len(padded), n) == (6, 4)
    with pytest.raises(ValueError, match="cannot be split over 3 data-parallel ranks"):
        batching.dp_slice(data, 0, 3)


def test_lr_schedule_warmup_then_decay():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=6)
    assert [round(lr_at(s, cfg), 4) for s in range(8)] == [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    cos = OptimConfig(lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="cosine", lr_decay_steps=4)
    assert [round(lr_at(s, cos), 4) for s in range(5)] == [1.0, 0.8536, 0.5, 0.1464, 0.0]
    assert lr_at(100, OptimConfig(lr=0.3)) == 0.3
    with pytest.raises(ConfigError, match="lr_decay_style=cosine needs a schedule length"):
        lr_at(0, OptimConfig(lr=1.0, lr_decay_style="cosine"))


def test_roles_must_share_the_actor_layout():
    base = {"trainer": {"n_gpus_per_node": 4}, "data": {"train_batch_size": 16},
            "actor_rollout_ref": {"actor": {"megatron": {"tensor_model_parallel_size": 2}}}}
    build_config(base)
    for section in ({"critic": {"enable": True, "megatron": {"tensor_model_parallel_size": 1}}},
                    {"actor_rollout_ref": {"ref": {"megatron": {"pipeline_model_parallel_size": 2}},
                                           "actor": {"megatron": {"tensor_model_parallel_size": 2}}}}):
        with pytest.raises(ConfigError, match="must use the actor's layout"):
            build_config({**base, **section})
