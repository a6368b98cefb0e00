"""The built-in engine beyond the shared contract: model families against transformers, continuous
batching, shared prefill, sleep levels, repetition penalty, sharding and refusals."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.protocol import DataProto
from megarl.rollout.base import SamplingParams
from megarl.rollout.native import NativeEngine, scheduler
from megarl.rollout.native.model import LocalSizes, ModelArgs
from megarl.rollout.native.tp import ShardPlan
from tests.rollout.conformance import PROMPTS, Oracle
from tests.rollout.fixtures import save_model, state_of, tiny_config

FAMILIES = {
    "qwen2": ("qwen2", {}),
    "llama-tied-llama3-rope-bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8})),
    "llama-linear-rope-theta": ("llama", dict(rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=24)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
    kind, extra = FAMILIES[family]
    model = save_model(str(tmp_path), kind, seed=3, **extra)
    engine, oracle = NativeEngine.from_pretrained(str(tmp_path)), Oracle(model)
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=12, do_sample=False))
    for prompt, g in zip(PROMPTS, greedy):
        assert g[0].token_ids == oracle.greedy(prompt, 12)
    sampled = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=0))
    err = max(oracle.max_error(greedy, PROMPTS, 1.0), oracle.max_error(sampled, PROMPTS, 0.8))
    print(f"{family}: max |log-prob - transformers| = {err:.2e}")
    assert err <= 1e-5


def test_repetition_penalty_greedy_matches_transformers(tmp_path):
    model = save_model(str(tmp_path), seed=4)
    engine, oracle = NativeEngine.from_pretrained(str(tmp_path)), Oracle(model)
    for prompt in PROMPTS:
        got = engine.generate([prompt], SamplingParams(max_tokens=12, do_sample=False, repetition_penalty=1.8))
        assert got[0][0].token_ids == oracle.greedy(prompt, 12, penalty=1.8)
        # the reported log-prob stays the convention's: before the penalty
        assert oracle.max_error(got, [prompt], 1.0) <= 1e-5


def test_continuous_batching_refills_slots_and_shares_prefill(tmp_path):
    """5 prompts x n=2 through 4 slots: the same tokens as with room for all, one prefill per prompt."""
    save_model(str(tmp_path), seed=5)
    prompts = PROMPTS + [[7, 7, 7], [60, 61, 62, 63]]
    sp = SamplingParams(n=2, max_tokens=10, seed=9, stop_token_ids=[5, 6, 7, 8])
    roomy = NativeEngine.from_pretrained(str(tmp_path))
    tight = NativeEngine.from_pretrained(str(tmp_path), max_num_seqs=4)
    want, got = roomy.generate(prompts, sp), tight.generate(prompts, sp)
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    flat = lambda groups: [x for g in groups for c in g for x in c.log_probs]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    assert tight.cache.rows == 4 and tight.stats["prefills"] == len(prompts)
    lengths = {len(c.token_ids) for g in got for c in g}
    assert len(lengths) > 1, "stop ids should end some sequences early (that frees slots)"


def test_sleep_frees_kv_cache_and_level_2_drops_weights(tmp_path):
    model = save_model(str(tmp_path), seed=6)
    oracle, greedy = Oracle(model), SamplingParams(max_tokens=6, do_sample=False)
    engine = NativeEngine.from_pretrained(str(tmp_path))
    engine.generate(PROMPTS, greedy)
    shape = engine.cache.shape
    engine.sleep(level=1)
    assert not engine.cache.allocated
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy)
    engine.wake()
    assert engine.cache.shape == shape
    assert engine.generate(PROMPTS[:1], greedy)[0][0].token_ids == oracle.greedy(PROMPTS[0], 6)

    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in engine.params.values()), "level 2 must release the weights"
    engine.wake()
    with pytest.raises(RuntimeError, match="sleep"):
        engine.generate(PROMPTS, greedy)
    engine.update_weights(state_of(model))                 # the next sync brings them back
    engine.finalize_weights()
    assert engine.generate(PROMPTS[:1], greedy)[0][0].token_ids == oracle.greedy(PROMPTS[0], 6)


def test_dummy_start_refuses_until_first_sync(tmp_path):
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.registry import build_rollout
    model = save_model(str(tmp_path), seed=7)
    engine = build_rollout(RolloutConfig(), str(tmp_path))      # load_format=dummy, as in verl
    assert engine.sleep_level == 2
    with pytest.raises(RuntimeError, match="no weights yet"):
        engine.generate(PROMPTS, SamplingParams())
    engine.update_weights(state_of(model))
    engine.finalize_weights()
    assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=5, do_sample=False))[0][0].token_ids == \
        Oracle(model).greedy(PROMPTS[0], 5)


def test_shard_plan_slices_reassemble_the_full_tensors():
    """Pure check of the TP layout: rank slices concatenate back to the HF tensors (KV heads
    replicated when there are fewer than ranks; vocabulary padded to a multiple of lcm(128, TP), as megatron
    pads it). Pre-sharded input (route_shard) lands where route puts the full tensor's part."""
    args = ModelArgs.from_hf(tiny_config("qwen2", vocab_size=97, num_key_value_heads=1).to_dict())
    full = {n: torch.randn(ShardPlan(args, 0, 1).full_shape(n)) for n in ShardPlan(args, 0, 1).expected_names()}
    parts = {}
    for rank in range(2):
        plan = ShardPlan(args, rank, 2)
        for name, t in full.items():
            for dst, rows, src in plan.route(name, t):
                parts.setdefault((name, dst, str(rows)), []).append(src)
    q = torch.cat(parts[("model.layers.0.self_attn.q_proj.weight", "layers.0.wqkv", str(slice(0, 32)))])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    k = parts[("model.layers.0.self_attn.k_proj.weight", "layers.0.wqkv", str(slice(32, 48)))]
    assert all(torch.equal(x, full["model.layers.0.self_attn.k_proj.weight"]) for x in k)   # replicated
    o = torch.cat(parts[("model.layers.1.self_attn.o_proj.weight", "layers.1.wo", str(slice(None)))], dim=1)
    assert torch.equal(o, full["model.layers.1.self_attn.o_proj.weight"])
    emb = [p for key, p in parts.items() if key[0] == "model.embed_tokens.weight"]
    assert torch.equal(torch.cat([x for p in emb for x in p]), full["model.embed_tokens.weight"])
    assert LocalSizes.of(args, 2).vocab == 64 and LocalSizes.of(args, 1).vocab == 97
    for rank in range(2):
        plan = ShardPlan(args, rank, 2)
        for name, t in full.items():
            (dst, rows, src), = plan.route(name, t)
            (dst2, rows2, src2), = plan.route_shard(name, plan.target(name)[2].take(t).clone())
            assert (dst, rows) == (dst2, rows2) and torch.equal(src, src2), name


def test_refusals(tmp_path):
    save_model(str(tmp_path), seed=8)
    engine = NativeEngine.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unknown tensor 'model.layers.9"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3, 3))])
    cfg = tiny_config("llama").to_dict()
    for bad, match in ((dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "yarn"),
                       (dict(model_type="gpt2"), "not supported"), (dict(hidden_act="gelu"), "gelu")):
        with pytest.raises(ValueError, match=match):
            ModelArgs.from_hf({**cfg, **bad})
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        LocalSizes.of(ModelArgs.from_hf(cfg), 3)


def test_generate_sequences_packs_truncated_prompts_consistently(tmp_path):
    """Left truncation: the batch keeps the prompt the engine generated from, so input_ids are
    exactly what the trainer must score."""
    save_model(str(tmp_path), seed=9)
    engine = NativeEngine.from_pretrained(str(tmp_path), prompt_length=4, prompt_truncation="left")
    batch = DataProto(non_tensor_batch={"prompt_token_ids": [PROMPTS[0], PROMPTS[1]]},
                      meta_info={"sampling": SamplingParams(n=2, max_tokens=5, seed=1)})
    out = engine.generate_sequences(batch)
    assert len(out) == 4 and engine.guard.truncated == 1
    assert list(out.non_tensor_batch["prompt_token_ids"][0]) == PROMPTS[0][-4:]
    for row in range(4):
        p, r = int(out.batch["prompt_lens"][row]), int(out.batch["response_lens"][row])
        prompt = list(out.non_tensor_batch["prompt_token_ids"][row])
        assert out.batch["input_ids"][row, :p].tolist() == prompt
        assert out.batch["input_ids"][row, p:p + r].tolist() == out.batch["responses"][row, :r].tolist()


def test_sequence_distribution_equals_the_models(tmp_path):
    """Two-step stop probabilities from 6000 samples (through refilled slots) against the exact
    values enumerated from transformers: P(stop at step 1) and P(stop at step 2)."""
    model = save_model(str(tmp_path), seed=2)
    engine = NativeEngine.from_pretrained(str(tmp_path), max_num_seqs=128)
    prompt, stops = [3, 17, 42, 8, 9], list(range(60, 80))
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        nxt = torch.softmax(model(torch.tensor([prompt + [t] for t in range(96)])).logits[:, -1], -1)  # [96, 96]
        keep = torch.ones(96, dtype=torch.bool)
        keep[stops] = False
        exact = [p1[stops].sum().item(), (p1[keep] * nxt[keep][:, stops].sum(-1)).sum().item()]
    counts, total = [0, 0, 0], 0
    for seed in range(12):
        for group in engine.generate([prompt] * 10,
                                     SamplingParams(n=50, max_tokens=3, seed=seed, stop_token_ids=stops)):
            for c in group:
                total += 1
                if c.finish_reason == "stop":
                    counts[len(c.token_ids) - 1] += 1
    for step, (count, p) in enumerate(zip(counts, exact), 1):
        z = (count / total - p) / math.sqrt(p * (1 - p) / total)
        print(f"P(stop at step {step}): sampled {count / total:.4f}, exact {p:.4f}, z = {z:+.2f}")
        assert abs(z) < 4.5


def test_samples_do_not_depend_on_batch_prefill_chunks_padding_or_slot_budget(tmp_path, monkeypatch):
    """A prompt's samples are the same tokens (log-probs within 1e-5) whether it is prefilled in
    one batched pass with the others, in chunks of one prompt (max_num_batched_tokens), in a new
    pass where it would make a pass more than half padding (scheduler.PAD_SPLIT),
    with slots sized from a memory budget (kv_cache_gb), or through the static-shape path that
    CUDA graphs replay (batch padded to a bucket with parked rows, attention span rounded up),
    here run eagerly on CPU. The log-probs stay the convention's (transformers within 1e-5)."""
    model = save_model(str(tmp_path), seed=10)
    prompts = PROMPTS + [[7, 7, 7], [60, 61, 62, 63], [5]]
    sp = SamplingParams(n=3, max_tokens=9, seed=4, temperature=0.9, top_k=30, top_p=0.95,
                        repetition_penalty=1.3, stop_token_ids=[5, 6, 7, 8])
    ref = NativeEngine.from_pretrained(str(tmp_path))
    want = ref.generate(prompts, sp)
    assert ref.stats["prefill_batches"] == 1 and ref.stats["prefills"] == len(prompts)
    assert Oracle(model).max_error(want, prompts, 0.9) <= 1e-5
    assert len({c.finish_reason for g in want for c in g}) == 2, "want both stop and length endings"

    chunked = NativeEngine.from_pretrained(str(tmp_path), max_num_batched_tokens=1, max_num_seqs=7)
    padded = NativeEngine.from_pretrained(str(tmp_path), max_num_seqs=11)
    padded.decode.static = True
    # n=3: 2/3 of a prompt group per row (module docstring of megarl/rollout/native/engine.py)
    per_row = ref.cache.bytes_per_token() * (9 + 2 / 3 * 9) + 6 * 8 + 9 * 12 + 96 + 8 * 2 / 3
    budget = NativeEngine.from_pretrained(str(tmp_path), kv_cache_gb=4.5 * per_row / 2**30)
    split = NativeEngine.from_pretrained(str(tmp_path))
    runs = {"chunked": chunked.generate(prompts, sp),
            "padded": padded.generate(prompts, sp), "budget": budget.generate(prompts, sp)}
    with monkeypatch.context() as m:
        m.setattr(scheduler, "PAD_SPLIT", 0)
        # lengths 5 2 9 3 4 1: the first five pad 23 tokens to 45; the sixth would pad 24 to 54
        runs["split"] = split.generate(prompts, sp)
    assert split.stats["prefill_batches"] == 2
    assert chunked.stats["prefill_batches"] == len(prompts)
    assert budget.cache.shape == (4, 3, 9, 9)           # rows, groups, prompt and generated positions
    flat = lambda groups: [x for g in groups for c in g for x in c.log_probs]  # noqa: E731
    for name, got in runs.items():
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want], name
        assert [[c.finish_reason for c in g] for g in got] == [[c.finish_reason for c in g] for g in want], name
        assert flat(got) == pytest.approx(flat(want), abs=1e-5), name


class _NoHostSync(TorchDispatchMode):
    """Fails on every aten op that reads a tensor's value back to the host (what a CUDA graph
    cannot capture): .item()/bool(), nonzero, masked_select, unique, equal. Records the rest."""
    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::item", "aten::masked_select",
             "aten::_unique2", "aten::unique_consecutive", "aten::equal", "aten::nonzero_static"}

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        assert name not in self.READS, f"{name} reads back to the host inside a decode step"
        self.ops.add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sp", [
    SamplingParams(n=2, max_tokens=6, seed=1, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(n=2, max_tokens=6, do_sample=False)], ids=["sampled", "greedy"])
def test_decode_step_reads_nothing_back_to_the_host(tmp_path, sp):
    """The step CUDA graphs capture (decode, sampling, recording; padded static shapes) runs
    here on CPU under a mode that fails on any op reading a value back to the host."""
    save_model(str(tmp_path), seed=12)
    engine = NativeEngine.from_pretrained(str(tmp_path))
    engine.generate(PROMPTS, sp)                          # allocates the cache and the row state
    mode = _NoHostSync()
    with mode:
        c = engine.cache                                  # every row and group, some parked
        engine.decode._run(c.rows, (c.groups, sp.n, c.prompt_len, c.gen_len), sp)
    assert "aten::index_put_" in mode.ops and ("aten::argmax" if sp.greedy else "aten::searchsorted") in mode.ops


def test_samples_share_their_prompts_kv_and_groups_are_recycled(tmp_path):
    """A prompt's K/V is written once, into a group its n samples share: the cache holds
    groups x prompt + rows x generated positions, so a KV budget fits more rows than copies
    per sample would. Groups whose samples all finished free up and the last active groups move
    into them; outputs stay those of an engine with room for everything, and transformers'."""
    model = save_model(str(tmp_path), seed=15)
    oracle = Oracle(model)
    long_prompts = [[(7 * i + j) % 90 + 3 for j in range(40 + 3 * i)] for i in range(6)]
    greedy = SamplingParams(n=8, max_tokens=4, do_sample=False)
    roomy = NativeEngine.from_pretrained(str(tmp_path))
    want = roomy.generate(long_prompts, greedy)
    for prompt, g in zip(long_prompts, want):
        assert all(c.token_ids == oracle.greedy(prompt, 4) for c in g)
    c = roomy.cache
    assert c.shape == (48, 6, 55, 4) and c.nbytes() == c.bytes_per_token() * (6 * 55 + 48 * 4)
    per_copy = c.bytes_per_token() * (55 + 4)             # one row holding its own copy of the prompt
    tight = NativeEngine.from_pretrained(str(tmp_path), kv_cache_gb=16 * per_copy / 2**30)
    got = tight.generate(long_prompts, greedy)
    assert [[x.token_ids for x in g] for g in got] == [[x.token_ids for x in g] for g in want]
    assert tight.cache.rows >= 3 * 16, f"a budget of 16 private copies holds {tight.cache.rows} shared rows"
    assert tight.cache.nbytes() <= 16 * per_copy
    tight.generate(long_prompts, greedy.with_(max_tokens=40))      # longer: fewer rows, same budget
    assert tight.cache.nbytes() <= 16 * per_copy and tight.cache.gen_len == 40 and tight.cache.rows < 48

    # Groups as the bottleneck: n=4 through 8 rows and 4 groups, stop ids ending samples at
    # different steps, so groups linger with one live sample and later groups move down.
    prompts = [[(5 * i + j) % 90 + 3 for j in range(2 + i % 5)] for i in range(10)]
    sp = SamplingParams(n=4, max_tokens=8, seed=3, temperature=1.0, stop_token_ids=list(range(20, 50)))
    want = roomy.generate(prompts, sp)
    small = NativeEngine.from_pretrained(str(tmp_path), max_num_seqs=8)
    got = small.generate(prompts, sp)
    assert small.cache.rows == 8 and small.cache.groups == 4
    assert small.stats["group_moves"] > 0 and len({len(x.token_ids) for g in got for x in g}) > 3
    assert [[x.token_ids for x in g] for g in got] == [[x.token_ids for x in g] for g in want]
    flat = lambda groups: [x for g in groups for c in g for x in c.log_probs]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    assert oracle.max_error(got, prompts, 1.0) <= 1e-5


def test_graph_buckets_are_geometric_and_capped():
    """Two captured sizes per octave, at most 1.5x padding, never past the capacity."""
    from megarl.rollout.native.rows import bucket
    assert sorted({bucket(x, 1000) for x in range(1, 1001)}) == \
        [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1000]
    assert all(x <= bucket(x, 10**6) <= max(1.5 * x, x + 1) for x in range(1, 5000))
    assert [bucket(x, 320, 128) for x in (1, 128, 129, 300)] == [128, 128, 256, 320]



def test_decode_attention_kernels_agree(tmp_path, monkeypatch):
    """attend(): torch's fused CPU flash kernel here, attend_matmul (what CUDA runs) elsewhere;
    both give the softmax output and its log-sum-exp, masked keys ignored, equal to SDPA; a whole
    generate through attend_matmul (static padded shapes, as graphs replay) gives transformers'
    greedy tokens and log-probs."""
    import torch.nn.functional as F
    from megarl.rollout.native.attention import MASKED, attend, attend_matmul
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 16, generator=g) for _ in range(3))
    bias = torch.zeros(3, 1, 1, 5)
    bias[0, ..., 3:] = MASKED
    for fn in (attend, attend_matmul):
        out, lse = fn(q, k, v, bias, 0.25)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), atol=1e-6)
        want = torch.logsumexp(q @ k.transpose(-1, -2) * 0.25 + bias, dim=-1, keepdim=True)
        assert torch.allclose(lse, want, atol=1e-5)
    from megarl.rollout.native import attention
    monkeypatch.setattr(attention, "_CPU_FLASH", None)
    oracle = Oracle(save_model(str(tmp_path), seed=16))
    engine = NativeEngine.from_pretrained(str(tmp_path))
    engine.decode.static = True
    greedy = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=10, do_sample=False))
    assert all(c.token_ids == oracle.greedy(p, 10) for p, grp in zip(PROMPTS, greedy) for c in grp)
    assert oracle.max_error(greedy, PROMPTS, 1.0) <= 1e-5
