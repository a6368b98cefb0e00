"""Activation recompute (gradient checkpointing) on real megatron-core over gloo: the gradients of a
policy loss are the same with and without it, for every way verl's keys ask for it, and an update
runs on CPU (megatron's checkpoint saves the CUDA generator's state: megarl/parallel/cpu_compat.py
maps that to a no-op there). The key mapping is checked in-process.

    python -m pytest -q tests/test_recompute.py
"""
from __future__ import annotations

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.models.build import transformer_config
from megarl.models.tiny import make_tiny_hf
from megarl.workers.config import ModelConfig, recompute_overrides
from tests.distributed import run_ranks

# (enable_gradient_checkpointing, gradient_checkpointing_kwargs, override_transformer_config)
WAYS = {
    "off": (False, {}, {}),
    "flag": (True, {}, {}),
    "flag_with_verl_nulls": (True, {}, {"recompute_granularity": None, "recompute_method": None,
                                         "recompute_num_layers": None, "recompute_modules": ["core_attn"]}),
    "full_block_2": (False, {}, {"recompute_granularity": "full", "recompute_method": "block",
                                 "recompute_num_layers": 2}),
    "selective_core_attn": (False, {}, {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
    "old_verl_kwargs": (True, {"activations_checkpoint_method": "uniform", "activations_checkpoint_granularity": "full",
                               "activations_checkpoint_num_layers": 2}, {}),
}


def grads_each_way(rank, world, path):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, OptimConfig
    from tests.helpers.megatron_roles import TEMP, make_batch, policy_loss

    state.init_distributed()   # the rank set-up; the engine starts no process group
    data, out = make_batch(301), {}
    for name, (flag, kwargs, over) in WAYS.items():
        cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
                          megatron=MegatronConfig(override_transformer_config=over), optim=OptimConfig(lr=1e-3))
        actor = ActorWorker(ModelConfig(path=path, enable_gradient_checkpointing=flag,
                                        gradient_checkpointing_kwargs=kwargs), cfg)
        tc = actor.engine.chunks[0].config
        actor.engine.accumulate(data, 4, actor._process(TEMP, True, True), policy_loss)
        out[name] = {"grads": dict(actor.engine.hf_grads()),
                     "config": (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers),
                     "update": actor.update_policy(data, policy_loss, TEMP)}
        del actor
    return out


def test_recompute_gives_the_same_gradients(tmp_path):
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", num_hidden_layers=4)
    out = run_ranks(1, grads_each_way, (path,))[0]
    assert out["off"]["config"] == (None, None, None)
    assert out["flag"]["config"] == out["flag_with_verl_nulls"]["config"] == ("full", "uniform", 1)
    assert out["full_block_2"]["config"] == ("full", "block", 2)
    assert out["selective_core_attn"]["config"][0] == "selective"
    assert out["old_verl_kwargs"]["config"] == ("full", "uniform", 2)
    ref = out["off"]["grads"]
    for name, r in out.items():
        assert set(r["grads"]) == set(ref), name
        worst = max((r["grads"][n] - ref[n]).abs().max().item() for n in ref)
        assert worst <= 1e-6, (name, worst)
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in r["update"].values()
                   if isinstance(v, (float, int, torch.Tensor))), name


def test_recompute_keys_map_to_megatron():
    from megarl.models.spec import ModelSpec
    spec = ModelSpec(architecture="Qwen2ForCausalLM", family="qwen2", head="lm", vocab_size=64, hidden_size=32,
                     ffn_hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, max_position_embeddings=128)

    def chosen(**kw):
        c = transformer_config(spec, 1, 1, **kw)
        return c.recompute_granularity, c.recompute_method, c.recompute_num_layers
    assert chosen() == (None, None, None)
    assert chosen(recompute=True) == ("full", "uniform", 1)
    assert chosen(recompute=True, overrides={"recompute_granularity": None, "recompute_num_layers": 3}) == \
        ("full", "uniform", 3)
    assert chosen(overrides={"recompute_granularity": "full"}) == ("full", "uniform", 1)
    assert chosen(recompute=True, overrides={"recompute_granularity": "selective"})[0] == "selective"
    assert recompute_overrides({"activations_checkpoint_method": "block", "use_reentrant": False}) == \
        {"recompute_method": "block"}
    with pytest.raises(ConfigError, match="activations_checkpoint_method"):
        ModelConfig(gradient_checkpointing_kwargs={"checkpoint_layers": 2})
