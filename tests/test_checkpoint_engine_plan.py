"""The weight-sync plan, pure (no processes): for training (TP, PP) x rollout TP, on models with
GQA or not, QKV bias or not, tied or untied embeddings and a vocabulary that needs padding,
every rank's bucket stream, built from shards that megarl's own HF -> megatron converter cut,
holds exactly the HF tensors (or the engine's part of them) the native engine expects."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.checkpoint_engine.plan import (build_plan, contains, local_names, narrow_to, split_shard, stage_names)
from megarl.checkpoint_engine.stream import bucket_stream
from megarl.models.convert import Slice, assemble, hf_shapes, hf_slices, hf_to_megatron
from megarl.models.spec import ModelSpec
from megarl.rollout.base import ShardSlice
from megarl.rollout.native.model import ModelArgs
from megarl.rollout.native.tp import ShardPlan

MODELS = {
    # Qwen2: QKV bias, GQA 8/2, untied head, vocab 301 (padded to 384)
    "qwen2-gqa-bias": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    # Llama: tied embeddings, no bias, MHA (4 KV heads)
    "llama-tied-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)]


def hf_config(family: str, **kw) -> dict:
    from transformers import LlamaConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    base = dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=4, head_dim=4)
    cfg = cls(**{**base, **kw}).to_dict()
    cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]
    return cfg


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    family, kw = MODELS[request.param]
    cfg = hf_config(family, **kw)
    spec = ModelSpec.from_hf_config(cfg)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in hf_shapes(spec).items()}
    return spec, ModelArgs.from_hf(cfg), full


def simulate(spec, args, full, tp, pp, rtp, shards: bool, bucket_bytes=3000):
    """Every rank of a colocated world (contiguous rollout groups, megatron's tp-dp-pp order):
    build the plan as the ranks would, fill each bucket buffer from real megatron shards, and
    return per rank the stream it would feed its engine, plus the plan."""
    world = math.lcm(tp * pp, rtp)
    dp = world // (tp * pp)
    ranks = []
    for g in range(world):
        t, p = g % tp, g // (tp * dp)
        engine = ShardPlan(args, g % rtp, rtp)
        want = (lambda n, e=engine: e.target(n)[2]) if shards else (lambda n: ShardSlice())
        ranks.append((t, p, want))
    local = set.intersection(*(local_names(spec, tp, t, pp, w) for t, _, w in ranks))
    plan = build_plan(spec, tp, pp, bucket_bytes, 4, local)
    shard = {(n, t): hf_to_megatron(n, full, spec, t, tp) for s in range(pp) for n in stage_names(spec, pp, s)
             for t in range(tp)}
    streams = []
    for t, p, want in ranks:
        got = []
        for b in plan.buckets:
            G = b.gather_numel
            buf = torch.zeros(b.numel(tp))
            for e in b.entries:
                if e.gather:
                    for r in range(tp):
                        buf[r * G + e.offset: r * G + e.offset + e.numel] = shard[(e.name, r)].reshape(-1)
                else:
                    buf[tp * G + e.offset: tp * G + e.offset + e.numel] = shard[(e.name, t)].reshape(-1)
            got += list(bucket_stream(plan, b, buf, t, None, want if shards else None))
        streams.append((want, got))
    return plan, streams


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("rtp", [1, 2, 4])
@pytest.mark.parametrize("shards", [True, False], ids=["engine-takes-shards", "full-tensors"])
def test_every_rank_receives_exactly_the_model(model, tp, pp, rtp, shards):
    spec, args, full = model
    if spec.num_kv_heads % tp or args.n_heads % rtp:
        pytest.skip("layout does not divide the heads")
    plan, streams = simulate(spec, args, full, tp, pp, rtp, shards)
    names = plan.hf_names()
    assert sorted(names) == sorted(full) and len(names) == len(set(names)), "each HF tensor exactly once"
    assert plan.hf_shapes() == {n: tuple(t.shape) for n, t in full.items()}
    assert plan.numel() == sum(t.numel() for t in full.values())
    for want, got in streams:
        assert [n for n, _ in got] == names
        for name, tensor in got:
            expect = want(name).take(full[name]) if shards else full[name]
            assert tensor.shape == expect.shape and torch.equal(tensor, expect), name


def test_equal_tp_skips_the_gather_and_other_layouts_need_it(model):
    spec, args, full = model
    split = [n for s in range(2) for n in stage_names(spec, 2, s) if n.endswith(("qkv.weight", "fc1.weight",
                                                                                   "fc2.weight", "proj.weight"))]
    plan, _ = simulate(spec, args, full, tp=2, pp=2, rtp=2, shards=True)
    gathered = [e.name for b in plan.buckets for e in b.entries if e.gather]
    assert gathered == [], "training TP = rollout TP: every shard is its engine's part, vocabulary included"
    plan, _ = simulate(spec, args, full, tp=2, pp=2, rtp=1, shards=True)
    gathered = {e.name for b in plan.buckets for e in b.entries if e.gather}
    assert set(split) <= gathered and "embedding.word_embeddings.weight" in gathered
    assert not any("layernorm" in n for n in gathered), "replicated norms never need a gather"
    plan, _ = simulate(spec, args, full, tp=2, pp=2, rtp=2, shards=False)   # an engine taking full tensors
    assert {e.name for b in plan.buckets for e in b.entries if e.gather} >= set(split)


def test_buckets_respect_the_size_and_stage_order(model):
    spec, args, full = model
    plan = build_plan(spec, 2, 2, 5000, 4, ())
    stages = [b.stage for b in plan.buckets]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    for b in plan.buckets:
        nbytes = 4 * b.numel(2)
        assert nbytes <= 5000 or len(b.entries) == 1, (b.index, nbytes)
        offsets = sorted((e.offset, e.numel) for e in b.entries if e.gather)
        assert all(a + n == c for (a, n), (c, _) in zip(offsets, offsets[1:])), "gathered entries packed"
    first = {e.name for b in plan.buckets if b.stage == 1 for e in b.entries}
    assert f"decoder.layers.{spec.num_layers // 2}.input_layernorm.weight" in first   # global layer names
    assert ("output_layer.weight" in first) != spec.tie_word_embeddings               # tied: embedding only
    with pytest.raises(ValueError, match="bucket_bytes"):
        build_plan(spec, 1, 1, 0, 4)
    assert plan.digest() == build_plan(spec, 2, 2, 5000, 4, ()).digest() != \
        build_plan(spec, 2, 2, 50000, 4, ()).digest()


def test_split_shard_inverts_assemble(model):
    spec, _, full = model
    for tp in (1, 2):
        for name in stage_names(spec, 1, 0):
            for t in range(tp):
                pieces = split_shard(name, hf_to_megatron(name, full, spec, t, tp), spec, t, tp)
                assert [s for s, _ in pieces] == hf_slices(name, spec, t, tp)
                for s, piece in pieces:
                    assert torch.equal(piece, s.take(full[s.hf_name])), (name, t)
                rebuilt = assemble(name, {s.hf_name: p for s, p in pieces}, spec, t, tp)
                assert torch.equal(rebuilt, hf_to_megatron(name, full, spec, t, tp))


def test_contains_and_narrow():
    rows = Slice("w", 0, 4, 8)
    assert contains(rows, ShardSlice(0, 4, 6)) and contains(rows, ShardSlice(0, 4, 8))
    assert not contains(rows, ShardSlice(0, 3, 6)) and not contains(rows, ShardSlice(1, 4, 6))
    assert not contains(rows, ShardSlice()) and contains(Slice("w"), ShardSlice(1, 0, 2))
    full = torch.arange(40.).view(10, 4)
    assert torch.equal(narrow_to(rows.take(full), rows, ShardSlice(0, 5, 7)), full[5:7])
    assert torch.equal(narrow_to(full, Slice("w"), ShardSlice(1, 1, 3)), full[:, 1:3])
