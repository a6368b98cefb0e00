"""Packing, token-budget plans and the lean log-prob, on one process (no spawn).

    python -m pytest -q tests/test_packing.py

The distributed half (TP2 / PP2 equality with the padded path) is tests/test_packing_distributed.py.
"""
from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import token_rows
from megarl.protocol import DataProto
from megarl.workers import batching, packing
from megarl.workers.logprob import linear_log_probs, token_log_probs


def _batch(lens_p, lens_r, R=None, vocab=50, seed=0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.tensor(lens_p), torch.tensor(lens_r)
    rows = token_rows(plen, rlen, R or int(rlen.max()), vocab, g, pad=1)
    del rows["response_mask"]
    return DataProto.from_dict(rows)


# -- plans -----------------------------------------------------------------------------------------------
def test_static_plan_is_todays_contiguous_split():
    assert batching.plan([5] * 8, dp=2, micro=2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@pytest.mark.parametrize("packed", [True, False])
def test_dynamic_plan_fits_budget_agrees_across_ranks_and_covers_every_row(packed):
    g = torch.Generator().manual_seed(1)
    lengths = (torch.randint(5, 60, (48,), generator=g)).tolist()
    lengths[7] = 100
    for dp in (1, 2, 4):
        plan = batching.plan(lengths, dp, micro=4, max_tokens=120, packed=packed)
        assert len({len(rank) for rank in plan}) == 1                      # same count on every DP rank
        rows = sorted(i for rank in plan for mb in rank for i in mb)
        assert rows == list(range(48))                                     # each row exactly once
        assert {len([i for mb in rank for i in mb]) for rank in plan} == {48 // dp}   # equal rows per rank
        assert all(batching.micro_cost(mb, lengths, packed) <= 120 for rank in plan for mb in rank)
    packed_count = len(batching.plan(lengths, 1, 4, 120, packed=True)[0])
    assert packed_count == -(-sum(lengths) // 120) or packed_count == -(-sum(lengths) // 120) + 1


def test_budget_below_longest_sequence_is_refused_naming_both():
    with pytest.raises(ValueError, match="sequence of 100 tokens exceeds the micro-batch token budget 64"):
        batching.plan([10, 100], 1, 1, max_tokens=64, packed=True)


def test_split_to_keeps_budget():
    bins = batching._split_to([[0, 1, 2, 3], [4]], 4, [9, 8, 7, 6, 5])
    assert len(bins) == 4 and sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]


# -- layouts ------------------------------------------------------------------------------------------------
def test_packed_input_positions_restart_and_index_the_right_tokens():
    mb = _batch([3, 2, 4], [2, 3, 1], R=3)
    inp = packing.packed_input(mb, length=20)
    assert inp.input_ids.shape == (1, 20) and inp.computed_tokens == 20
    assert inp.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 10, 15, 20]
    assert inp.position_ids[0, :15].tolist() == [0, 1, 2, 3, 4] * 3
    assert inp.packed_seq_params.max_seqlen_q == 5
    flat = inp.input_ids[0]
    # the token after each out_index position is the response token it predicts
    for i in range(3):
        for j in range(int(mb.batch["response_lens"][i])):
            assert flat[inp.out_index[i, j] + 1] == mb.batch["responses"][i, j]
        assert flat[inp.last_index[i]] == mb.batch["input_ids"][i, int(mb.batch["prompt_lens"][i] +
                                                                   mb.batch["response_lens"][i]) - 1]


def test_widths_and_computed_tokens():
    lens = [[5, 3], [9], [2, 2, 2]]
    assert packing.widths(lens, True, 9, common=False) == [8, 9, 6]
    assert packing.widths(lens, True, 9, common=True, multiple=4) == [12, 12, 12]
    assert packing.computed_tokens(lens, True, 9, common=False) == 23          # no padding at all
    assert packing.computed_tokens(lens, False, 9, common=True) == 9 * 6       # today's: all rows at the longest
    assert packing.computed_tokens(lens, False, 9, common=False) == 10 + 9 + 6


def test_varlen_attention_equals_block_diagonal_mask():
    from megarl.models.varlen import varlen_causal
    g = torch.Generator().manual_seed(0)
    seg = [4, 1, 6, 3]
    T, H, KV, D = sum(seg), 4, 2, 8
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KV, KV))
    cu = torch.tensor([0, 4, 5, 11, 14], dtype=torch.int32)
    got = varlen_causal(q, k, v, cu, max(seg), scale=0.3)
    owner = torch.repeat_interleave(torch.arange(len(seg)), torch.tensor(seg))
    allowed = (owner[:, None] == owner[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed, scale=0.3).transpose(0, 1)
    assert (got - ref).abs().max() < 1e-6


def test_varlen_groups_of_similar_length_equal_one_call_per_sequence():
    """varlen_causal pads sequences of similar length into one SDPA call (long ones keep a call
    each): outputs and gradients equal attention run on each sequence alone."""
    from megarl.models.varlen import length_groups, varlen_causal
    g = torch.Generator().manual_seed(1)
    seg = [7, 300, 5, 9, 0, 120, 33, 8, 1]
    groups = length_groups(seg)
    assert sorted(i for grp in groups for i in grp) == [i for i, n in enumerate(seg) if n]
    assert [300] in [[seg[i] for i in grp] for grp in groups] and len(groups[-1]) >= 5   # long alone, short together
    T, H, KV, D = sum(seg), 4, 2, 8
    q, k, v = (torch.randn(T, n, D, generator=g, requires_grad=True) for n in (H, KV, KV))
    cu = torch.tensor([0] + torch.tensor(seg).cumsum(0).tolist(), dtype=torch.int32)
    got = varlen_causal(q, k, v, cu, max(seg), scale=0.3)
    bounds = cu.tolist()
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].repeat_interleave(2, 1).transpose(0, 1),
        v[a:b].repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.3).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
    assert (got - ref).abs().max() < 1e-6
    upstream = torch.randn(got.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), upstream), torch.autograd.grad(ref, (q, k, v), upstream)):
        assert (a - b).abs().max() < 1e-5


# -- the lean log-prob --------------------------------------------------------------------------------------
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_linear_log_probs_match_materialised_logits_values_and_grads(entropy_grad):
    g = torch.Generator().manual_seed(0)
    n, h, vocab, padded_vocab, T = 37, 16, 45, 48, 0.7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float()
    weight = torch.randn(padded_vocab, h, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(fn):
        hd, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(hd, w)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0)
        loss.backward()
        return lp.detach(), ent.detach(), hd.grad, w.grad, ent.requires_grad

    ref = run(lambda hd, w: token_log_probs((hd @ w.t()) / T, targets, 0, vocab))
    got = run(lambda hd, w: linear_log_probs(hd, w, targets, 0, vocab, None, T, True, entropy_grad, chunk=8))
    for a, b in zip(ref[:4], got[:4]):
        assert (a - b).abs().max() < 1e-5
    assert got[4] == entropy_grad                       # a metric-only entropy carries no gradient
    assert (got[3][vocab:] == 0).all()                  # padded vocabulary rows get no gradient


def test_lean_log_prob_peak_memory_is_at_least_2x_lower_at_152k_vocab():
    """Peak bytes allocated by one forward+backward of the log-prob on [256 tokens, 152k vocab] fp32,
    measured by torch's CPU memory profiler; the model's hidden states and the weight are inputs."""
    g = torch.Generator().manual_seed(0)
    n, h, V = 256, 16, 152064
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(V, h, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)

    def today():
        logits = hidden @ weight.t()                       # what the output layer hands back today
        lp, ent = token_log_probs(logits / 1.0, targets, 0, V)
        (lp.sum() + ent.sum()).backward()

    def lean():
        lp, ent = linear_log_probs(hidden, weight, targets, 0, V, None, 1.0, True, False)
        lp.sum().backward()

    from benchmarks.update_memory import peak_alloc_bytes
    peaks = {}
    for name, fn in (("today", today), ("lean", lean)):
        hidden.grad = weight.grad = None
        peaks[name] = peak_alloc_bytes(fn)
    assert peaks["today"] > 2 * peaks["lean"], peaks


# -- config ---------------------------------------------------------------------------------------------------
def test_token_budget_keys_take_the_actors_and_refuse_a_budget_below_the_longest_sequence():
    from megarl.config import ConfigError
    from megarl.experiment import load_config
    cfg = load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"])
    ro, ref = cfg.rollout, cfg.actor_rollout_ref.ref
    assert (ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu) == (True, 4096)
    assert (ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu) == (True, 4096)
    assert (cfg.critic.use_dynamic_bsz, cfg.critic.forward_max_token_len_per_gpu) == (True, 4096)
    longest = ro.prompt_length + ro.response_length
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                           f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={longest - 1}"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu:")
    assert f"budget of {longest - 1}" in msg and f"= {longest}" in msg
    with pytest.raises(ConfigError, match="use_remove_padding: token-budget micro-batches under pipeline"):
        load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true", "trainer.n_gpus_per_node=2",
                           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                           "actor_rollout_ref.model.use_remove_padding=false"])


def test_update_memory_benchmark_runs_a_tiny_shape(tmp_path):
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "update_memory.py"), "--batch", "4", "--micro",
                    "2", "--prompt", "8", "--response", "24", "--mean-response", "6", "--max-tokens", "64", "--vocab",
                    "512", "--hidden", "32", "--layers", "1", "--repeats", "1", "--json", str(out)],
                   check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())
    got = {r["name"]: r for r in rows}
    assert len(rows) == 5
    # offload acts on CUDA only: on CPU the offload row holds what the others hold, and says so
    assert got["packed, dyn, offload"]["held_mib"] == got["packed, dynamic"]["held_mib"] > 0
    assert got["packed, static"]["padding"] == 1.0 < got["padded, static"]["padding"]
    assert all(r["lp_mib"] > 0 and r["up_mib"] > 0 and r["up_s"] > 0 for r in rows)


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_is_megatrons_loop_bit_for_bit_in_one_gather(interleaved):
    """megarl/models/packed_rope.py replaces megatron's per-sequence THD RoPE; the oracle is
    megatron-core's own function, for the max-length table and the one-row-per-token table."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.models import packed_rope

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 1, 9, 3, 3, 12])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    total = int(cu[-1])
    t = torch.randn(total, 4, 16, generator=g, requires_grad=True)
    for table in (torch.randn(16, 1, 1, 16, generator=g), torch.randn(total, 1, 1, 16, generator=g)):
        kw = dict(rotary_interleaved=interleaved, cp_group=OneRank())
        ours, theirs = packed_rope.apply_thd(t, cu, table, **kw), packed_rope._MEGATRON(t, cu, table, **kw)
        assert torch.equal(ours, theirs)
        assert torch.equal(*(torch.autograd.grad(x.square().sum(), t)[0] for x in (ours, theirs)))
    assert packed_rope.packed_positions(cu, total).tolist() == [p for n in lens.tolist() for p in range(n)]
    assert packed_rope.install() and rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_thd
    with pytest.raises(ValueError, match="cu_seqlens ends at 33 but the tensor has 32 tokens"):
        packed_rope.apply_thd(t[:-1], cu, table, cp_group=OneRank())


def test_packed_rope_keeps_megatrons_function_where_its_source_differs(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.models import packed_rope
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", packed_rope._MEGATRON)
    monkeypatch.setattr(packed_rope, "CHECKED", "another megatron")
    assert not packed_rope.install() and rope_utils._apply_rotary_pos_emb_thd is packed_rope._MEGATRON
