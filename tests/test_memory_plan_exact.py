"""The memory plan's static part (megarl/launcher/memory_plan.py) against the bytes a built model
and optimizer hold: real megatron-core over gloo, tiny shapes.

    python -m pytest -q tests/test_memory_plan_exact.py

One rank, then one grouped spawn of four: TP 2 x DP 2 with megarl's CPU optimizer after one update,
PP 2 x VPP 2 with tied embeddings and EP 2 experts wrapped in megatron's DDP with the distributed
optimizer's buffers, whose per-DP-rank slices come from megatron's own DistributedOptimizer range
code (the optimizer itself needs CUDA: its state is those slices' elements times the bytes per element).
"""
from __future__ import annotations

import json
import os

import pytest

from megarl.launcher.memory_terms import Layout, buffer_layout, static_bytes
from megarl.models.spec import ModelSpec
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks


def _held_after_a_step(actor) -> dict:
    """Storage bytes of every parameter, DDP grad buffer and optimizer state tensor, after an update."""
    import torch
    from megarl.workers.offload import resident_bytes
    from tests.helpers.megatron_roles import TEMP, make_batch, policy_loss
    eng = actor.engine
    actor.update_policy(make_batch(eng.spec.vocab_size, seed=3), policy_loss, TEMP)
    mem, dev = eng.memory, eng.device
    opt = eng.optimizer.optimizer                   # CPUAdamW's torch AdamW
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert states, "the update made no optimizer state"
    return {"params": resident_bytes(mem.param_tensors(), dev), "grads": resident_bytes(mem.grad_tensors(), dev),
            "optimizer": resident_bytes(states, dev)}


def _one_rank(rank, world, path):
    from tests.helpers.megatron_roles import make_actor
    return _held_after_a_step(make_actor(path, 4))


def _planned(path: str, lay: Layout, pp_rank: int = 0) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    s = static_bytes(spec, lay, pp_rank)
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer}


@pytest.mark.parametrize("family", ["qwen3"])
def test_static_plan_is_exact_on_one_rank(tmp_path, family):
    path = make_tiny_hf(str(tmp_path / family), family, num_hidden_layers=2)
    held = run_ranks(1, _one_rank, (path,))[0]
    assert held == _planned(path, Layout(param_bytes=4, host_step=True))


def _dist_wrapped(spec_path, tp, pp, vpp, ep):
    """Megatron DDP with the distributed optimizer's buffers: bytes of params (views into the param
    buffer) and grads, and the elements this DP rank's optimizer covers (megatron's own ranges)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megarl.workers.offload import resident_bytes
    from megarl.workers.preflight import EngineSpec, read_spec
    from megarl.workers.shards import Shards
    es = EngineSpec(spec_path, tp=tp, pp=pp, vpp=vpp, ep=ep, trainable=True, use_distributed_optimizer=True)
    spec, _, _ = read_spec(es)
    shards = Shards(es, spec, torch.float32)
    chunks = shards.wrap()
    buffers = [b for c in chunks for b in c.buffers + c.expert_parallel_buffers]
    elements = 0
    for b in buffers:
        for ranges in DistributedOptimizer._build_gbuf_range_map(b).values():
            elements += sum(r["param"].size for bucket in ranges for r in bucket["param_map"].values())
    out = {"params": resident_bytes(list(shards.parameters()), shards.device),
           "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
           "elements": elements, "pp_rank": shards.layout.pp_rank}
    del chunks, shards
    _destroy()
    return out


def _destroy():
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()


def _four_ranks(rank, world, dense, tied, moe):
    from tests.helpers.megatron_roles import make_actor
    out = {"tp2": _held_after_a_step(make_actor(dense, 4, tp=2))}
    _destroy()
    out["pp2_vpp2_tied"] = _dist_wrapped(tied, 1, 2, 2, 1)
    out["ep2"] = _dist_wrapped(moe, 1, 1, None, 2)
    return out


def test_static_plan_is_exact_on_four_ranks(tmp_path):
    dense = make_tiny_hf(str(tmp_path / "dense"), "qwen2", num_hidden_layers=2)
    # 48-wide norms and odd vocabulary rows, so megatron's 64-element alignment pads between parameters
    tied = make_tiny_hf(str(tmp_path / "tied"), "qwen2", num_hidden_layers=4, tie_word_embeddings=True,
                        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=300)
    moe = make_tiny_hf(str(tmp_path / "moe"), "qwen2_moe", num_hidden_layers=2)
    got = run_ranks(4, _four_ranks, (dense, tied, moe))
    for r in got:
        assert r["tp2"] == _planned(dense, Layout(tp=2, dp=2, param_bytes=4, host_step=True))
    for case, path, lay in (("pp2_vpp2_tied", tied, Layout(pp=2, vpp=2, dp=2, distributed_optimizer=True,
                                                            param_bytes=4)),
                            ("ep2", moe, Layout(ep=2, dp=4, distributed_optimizer=True, param_bytes=4))):
        for pp_rank in range(lay.pp):
            ranks = [r[case] for r in got if r[case]["pp_rank"] == pp_rank]
            plan = _planned(path, lay, pp_rank)
            assert {r["params"] for r in ranks} == {plan["params"]}, case
            assert {r["grads"] for r in ranks} == {plan["grads"]}, case
            # fp32 weights: the distributed optimizer's masters are the weights; two fp32 moments each
            assert max(r["elements"] for r in ranks) * 8 == plan["optimizer"], case


def test_buffer_layout_pads_as_megatron_does():
    # two parameters, the first of 100 elements: the second starts at 128 (64-aligned after it, walked
    # backwards), and the bucket ends at lcm(DP 3, 128) = 384
    numel, buckets, ranges = buffer_layout([(100, False), (70, False)], dp=3, distributed=True)
    assert ranges == [(128, 228), (0, 70)] and buckets == [(0, 384)] and numel == 384
    assert buffer_layout([(100, False), (70, False)], dp=3, distributed=False)[0] == 170
