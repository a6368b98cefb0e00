"""Rollout TP above the model's KV heads: the built-in engine at TP 4 on a model with 2 KV heads,
fed by the weight sync from a real megatron actor at TP 2 (4 gloo ranks, one spawn).

    python -m pytest -q tests/test_rollout_kv_replication.py

Each engine rank holds KV head rank * 2 // 4 (vLLM's QKVParallelLinear, TensorRT-LLM's
duplicate_kv_weight), which the trainer's TP rank beside it does not hold for ranks 1 and 2, so the
plan gathers q/k/v. The engine's log-probs equal the TP-1 engine's and the actor's, token for token.
"""
from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.checkpoint_engine import (actor_at, engine_mismatch, experiment, full_export,
                                             generated_batch, native_engine, rollout_groups, rollout_vs_actor)

TP, RTP, KV = 2, 4, 2


def replicated(rank, world, path):
    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.rollout.native import NativeEngine

    actor = actor_at(path, TP, 1)
    group = rollout_groups(RTP)
    engine = native_engine(path, group)
    sync = build_checkpoint_engine(experiment(path, TP, 1, RTP, bucket_size_mb=0.1), actor, engine, group)
    sync.sync()
    out = {"gathered": sorted({e.name.split(".", 3)[-1] for b in sync.plan.buckets for e in b.entries if e.gather})}
    export = full_export(actor)
    out["exact"] = engine_mismatch(engine, export)
    # The KV rows this rank holds, against the full k/v_proj cut by the rule itself.
    a, hd = engine.args, engine.args.head_dim
    head = rank * KV // RTP
    wqkv = engine.params["layers.0.wqkv"].data
    q_rows = a.n_heads // RTP * hd
    out["k_row_error"] = (wqkv[q_rows:q_rows + hd] - export["model.layers.0.self_attn.k_proj.weight"][
        head * hd:(head + 1) * hd]).abs().max().item()
    out["v_row_error"] = (wqkv[q_rows + hd:q_rows + 2 * hd] - export["model.layers.0.self_attn.v_proj.weight"][
        head * hd:(head + 1) * hd]).abs().max().item()
    out["vs_actor"], _ = rollout_vs_actor(engine, actor)
    many, one = generated_batch(engine), generated_batch(NativeEngine.from_pretrained(path))
    out["tokens_equal"] = torch.equal(many.batch["responses"], one.batch["responses"])
    mask = one.batch["response_mask"].bool()
    out["vs_tp1"] = (many.batch["rollout_log_probs"] - one.batch["rollout_log_probs"]).abs()[mask].max().item()
    out["scored"] = int(mask.sum())
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_tiny_hf(str(tmp_path_factory.mktemp("kv_rep") / "m"), "qwen2", seed=4, vocab_size=301)
    from megarl.models.hf_config import read_hf_config
    cfg = read_hf_config(path)
    assert cfg["num_key_value_heads"] == KV and cfg["num_attention_heads"] % RTP == 0
    return path


@pytest.mark.timeout(900)
def test_rollout_tp_above_kv_heads_matches_tp1(tiny_model):
    results = run_ranks(RTP, replicated, (tiny_model,))
    for rank, r in enumerate(results):
        assert r["exact"] == (0.0, []), (rank, r["exact"])
        assert r["k_row_error"] == 0.0 and r["v_row_error"] == 0.0, rank
        assert r["vs_actor"] < 1e-5, (rank, r["vs_actor"])
        assert r["tokens_equal"] and r["scored"] > 0, rank
        assert r["vs_tp1"] < 1e-5, (rank, r["vs_tp1"])
        print(f"rank {rank}: |engine - actor| {r['vs_actor']:.1e}, |TP4 - TP1| {r['vs_tp1']:.1e} over "
              f"{r['scored']} tokens; gathered {r['gathered']}")
    assert any("linear_qkv" in name for name in results[0]["gathered"])


def test_rollout_tp_rule_takes_replication_and_refuses_the_rest():
    """The rule alone (the config's other rules tie rollout TP to the rank count): all it reads."""
    from types import SimpleNamespace

    from megarl.config.errors import ConfigError
    from megarl.rollout.config_checks import check_model_rollout_tp

    def at(rtp):
        return SimpleNamespace(rollout=SimpleNamespace(tensor_model_parallel_size=rtp))
    for rtp in (1, 2, 4, 8, 16, 32):                       # divides 4, or a multiple of 4 dividing 32
        check_model_rollout_tp(at(rtp), {"num_attention_heads": 32, "num_key_value_heads": 4})
    for rtp, heads in ((6, 24), (3, 24), (16, 8)):         # neither divides; heads not divided
        with pytest.raises(ConfigError, match=f"rollout TP {rtp} must divide the model's {heads} attention heads"):
            check_model_rollout_tp(at(rtp), {"num_attention_heads": heads, "num_key_value_heads": 4})
