"""Sequence / context / virtual-pipeline layouts without spawning: config rules (one-line errors
naming the key and a layout that works), sequence padding and the load-balanced CP split, CP
attention's chunk masks against plain causal attention, and the virtual-pipeline layer maps the
weight-sync plan uses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.config import ConfigError
from megarl.experiment import load_config

A = "actor_rollout_ref.actor"
BASE = ["trainer.n_gpus_per_node=4", "data.train_batch_size=8", f"{A}.ppo_mini_batch_size=4",
        f"{A}.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=2"]


def cfg(*extra):
    return load_config(None, BASE + list(extra))


def refused(*extra) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        cfg(*extra)
    assert "\n" not in str(err.value)
    return err.value


def test_sequence_parallel_defaults_on_with_tp_and_is_off_at_tp1():
    assert cfg(f"{A}.megatron.tensor_model_parallel_size=2").actor.megatron.sequence_parallel_on is True
    assert cfg().actor.megatron.sequence_parallel_on is False
    assert cfg(f"{A}.megatron.tensor_model_parallel_size=2",
               f"{A}.megatron.sequence_parallel=false").actor.megatron.sequence_parallel_on is False
    # verl's default is true at every TP; at TP 1 verl turns it off (no TP group to split over), as megarl does
    assert cfg(f"{A}.megatron.sequence_parallel=true").actor.megatron.sequence_parallel_on is False


def test_context_and_virtual_pipeline_layout_rules():
    c = cfg(f"{A}.megatron.context_parallel_size=2")
    assert c.data_parallel_size() == 2
    err = refused(f"{A}.megatron.context_parallel_size=3")
    assert "x CP 3" in str(err) and err.key.endswith("tensor_model_parallel_size")
    err = refused(f"{A}.megatron.virtual_pipeline_model_parallel_size=2")
    assert err.key.endswith("virtual_pipeline_model_parallel_size") and "pipeline_model_parallel_size=2" in str(err)
    # 8 sequences per mini batch at DP 2: micro 2 gives 2 micro-batches (a multiple of PP 2), micro 4
    # gives 1, which the interleaved schedule refuses; the error names a micro size that works.
    err = refused(f"{A}.megatron.pipeline_model_parallel_size=2",
                  f"{A}.megatron.virtual_pipeline_model_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4")
    assert err.key.endswith("ppo_micro_batch_size_per_gpu") and "ppo_micro_batch_size_per_gpu=2" in str(err)
    ok = cfg(f"{A}.megatron.pipeline_model_parallel_size=2", f"{A}.megatron.virtual_pipeline_model_parallel_size=2")
    ok.check_model({"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4})
    with pytest.raises(ConfigError) as err:
        ok.check_model({"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6})
    assert err.value.key.endswith("virtual_pipeline_model_parallel_size") and "e.g. 3" in str(err.value)
    # Roles share megatron's process-global layout, CP and VPP included.
    err = refused(f"{A}.megatron.context_parallel_size=2", "actor_rollout_ref.ref.megatron.context_parallel_size=1",
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1")
    assert "differs from the actor's" in str(err)
    err = refused("actor_rollout_ref.rollout.placement=disaggregated",
                  "actor_rollout_ref.rollout.disaggregated_ranks=2",
                  f"{A}.megatron.context_parallel_size=2")
    assert err.key == "actor_rollout_ref.rollout.placement" and "placement=colocated" in str(err)


def test_preflight_refuses_uneven_chunks_before_building():
    from megarl.models.spec import ModelSpec
    from megarl.workers.preflight import check_chunks
    spec = ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2})
    check_chunks(spec, 2, 3)
    with pytest.raises(ConfigError, match="PP 2 x VPP 2.*e.g. 3"):
        check_chunks(spec, 2, 2)


def test_padding_and_load_balanced_split():
    from megarl.models.context_parallel import _reorder, chunk_ids, split_sequence
    from megarl.parallel.sequence import pad_columns, padded_length
    assert padded_length(37, tp=2) == 38 and padded_length(37, cp=2) == 40 and padded_length(37, tp=2, cp=2) == 40
    assert padded_length(40, tp=2, cp=2) == 40 and padded_length(5) == 5
    ids = torch.arange(10).view(1, 10)
    assert pad_columns(ids, 12)[0, -2:].tolist() == [0, 0] and pad_columns(ids, 10) is ids
    x = torch.arange(16).view(1, 16)
    parts = [split_sequence(x, r, 2, dim=1) for r in range(2)]
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and parts[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(_reorder(parts, 1), x)
    with pytest.raises(ValueError, match="multiple of 2 x CP"):
        split_sequence(torch.zeros(1, 6), 0, 2, dim=1)


def test_cp_chunk_attention_equals_causal_attention():
    """Each CP rank's two chunks attend the gathered K/V with their causal offsets: stitched back,
    the result is plain causal attention over the whole sequence (CP 2 and 3)."""
    from megarl.models.context_parallel import _reorder, causal_chunk_attention, chunk_ids, split_sequence
    g = torch.Generator().manual_seed(0)
    for cp in (2, 3):
        S = 4 * cp
        q, k, v = (torch.randn(2, 3, S, 8, generator=g) for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        outs = []
        for r in range(cp):
            ql = split_sequence(q, r, cp, dim=2)
            c = ql.shape[2] // 2
            outs.append(torch.cat([causal_chunk_attention(part, k, v, idx * c, 8 ** -0.5, 0.0)
                                   for part, idx in zip(ql.split(c, dim=2), chunk_ids(r, cp))], dim=2))
        assert (_reorder(outs, 2) - full).abs().max() < 1e-6


def test_virtual_pipeline_layer_maps():
    from megarl.checkpoint_engine.plan import build_plan, stage_names
    from megarl.models.spec import ModelSpec, stage_layers
    spec = ModelSpec.from_hf_config({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 2})
    assert stage_layers(spec, 0, 2, 2) == [0, 1, 4, 5] and stage_layers(spec, 1, 2, 2) == [2, 3, 6, 7]
    assert stage_layers(spec, 1, 2) == [4, 5, 6, 7]
    with_vpp = [stage_names(spec, 2, s, vpp=2) for s in range(2)]
    without = [stage_names(spec, 2, s) for s in range(2)]
    assert sorted(with_vpp[0] + with_vpp[1]) == sorted(without[0] + without[1])
    assert "decoder.layers.4.mlp.linear_fc1.weight" in with_vpp[0] and "embedding.word_embeddings.weight" in with_vpp[0]
    plan = build_plan(spec, 2, 2, 1 << 20, 4, (), vpp=2)
    assert {e.name for b in plan.buckets if b.stage == 1 for e in b.entries} == set(with_vpp[1])


def test_megatron_core_has_what_megarl_uses():
    from megarl.models import mcore
    assert mcore.missing() == [] and mcore.version() >= (0, 16, 1)
    mcore.require()
