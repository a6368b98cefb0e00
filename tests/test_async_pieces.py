"""The pieces of async training, one process: off-policy corrections and staleness on
hand-computed numbers, and partial (chunked) generation on the native engine against
transformers as the oracle, with a weight update between two chunks."""
import math

import pytest
import torch

from megarl.algos.rollout_correction import masked_token_fraction, rollout_is_metrics, rollout_is_weights
from megarl.algos.staleness import sample_versions, stale_rows, staleness_metrics
from tests.helpers.stream_parts import PROMPTS3, TrainerSide, native_engine, rollout_worker, stream_worker
from tests.helpers.stream_parts import prompts as three_prompts

# ratios r = pi_old / pi_rollout per token: 1.0, 2.0, 0.5, 4.0 | 1.2, 0.25, (pad), (pad)
R = torch.tensor([[1.0, 2.0, 0.5, 4.0], [1.2, 0.25, 1.0, 1.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
ROLL = torch.zeros(2, 4)
OLD = R.log()


def test_masked_is_and_icepop_by_hand():
    c = 3.0
    tis = rollout_is_weights(OLD, ROLL, MASK, "token", c)
    assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 0.5, 3.0], [1.2, 0.25, 0, 0]]))
    mis = rollout_is_weights(OLD, ROLL, MASK, "masked_token", c)        # r > c -> 0
    assert torch.allclose(mis, torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.2, 0.25, 0, 0]]))
    ice = rollout_is_weights(OLD, ROLL, MASK, "icepop", c)              # r outside [1/3, 3] -> 0
    assert torch.allclose(ice, torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.2, 0.0, 0, 0]]))
    assert masked_token_fraction(ice, MASK) == pytest.approx(2 / 6)
    assert masked_token_fraction(mis, MASK) == pytest.approx(1 / 6)
    # sequences: prod r = 4.0 and 0.3
    seq = rollout_is_weights(OLD, ROLL, MASK, "sequence", c)
    assert torch.allclose(seq, torch.tensor([[3.0] * 4, [0.3, 0.3, 0, 0]]))
    mseq = rollout_is_weights(OLD, ROLL, MASK, "masked_sequence", c)
    assert torch.allclose(mseq, torch.tensor([[0.0] * 4, [0.3, 0.3, 0, 0]]))
    m = rollout_is_metrics(OLD, ROLL, MASK, "icepop", c)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 6)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="icepop"):
        rollout_is_weights(OLD, ROLL, MASK, "nope", c)


def test_icepop_in_the_actor_loss_removes_masked_tokens():
    from megarl.algos.loss_fn import make_actor_loss_fn
    from megarl.experiment import load_config
    from megarl.protocol import DataProto
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=icepop",
                             "algorithm.rollout_correction.rollout_is_threshold=3", "algorithm.adv_estimator=grpo",
                             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.loss_agg_mode=token-mean"])
    fn = make_actor_loss_fn(cfg)
    logp = OLD.clone().requires_grad_(True)
    b = DataProto({"response_mask": MASK, "old_log_probs": OLD, "rollout_log_probs": ROLL,
                   "advantages": torch.ones(2, 4), "response_lens": MASK.sum(-1)})
    loss, metrics = fn({"log_probs": logp}, b)
    loss.backward()
    assert float(metrics["rollout_corr/masked_token_fraction"]) == pytest.approx(2 / 6)
    g = logp.grad
    assert g[0, 3] == 0 and g[1, 1] == 0                       # masked tokens carry no gradient
    assert g[0, 0] != 0 and g[0, 1] != 0 and g[1, 0] != 0


def test_staleness_by_hand():
    # versions per token; -1 is padding. Sample 2 spans versions 3 and 4 (a partial rollout).
    tv = torch.tensor([[4, 4, -1], [3, 3, 3], [3, 4, 4], [5, -1, -1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])   # sample 3: empty, started under 5
    oldest, newest = sample_versions(tv, mask)
    assert oldest.tolist() == [4, 3, 3, 5] and newest.tolist() == [4, 3, 4, 5]
    assert stale_rows(tv, mask, current_version=5, max_staleness=1).tolist() == [False, True, True, False]
    assert stale_rows(tv, mask, current_version=5, max_staleness=2).tolist() == [False] * 4
    m = staleness_metrics(tv, mask, current_version=5, bins=2)
    assert m["async/staleness_hist/0"] == 0.25 and m["async/staleness_hist/1"] == 0.25
    assert m["async/staleness_hist/2+"] == 0.5
    assert m["async/staleness_mean"] == pytest.approx((1 + 2 + 2 + 0) / 4) and m["async/staleness_max"] == 2
    assert m["async/mixed_version_fraction"] == 0.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("partial") / "qwen2"), "qwen2", seed=3, vocab_size=301,
                        tokenizer=False)


def _greedy_oracle(model, prompt, n_tokens):
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt):], lps


def test_partial_rollout_continues_under_new_weights(tiny):
    from transformers import AutoModelForCausalLM

    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.partial import ChunkedGeneration
    from megarl.rollout.registry import build_rollout

    engine = build_rollout(RolloutConfig(name="native", dtype="float32"), tiny)
    v0 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    engine.update_weights(v0.state_dict().items())     # built without weights: v0 arrives as a sync would
    engine.finalize_weights()
    prompts = [[5, 17, 42, 8], [3, 3, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Without an interruption, chunks of 2 give what one call gives.
    whole = engine.generate(prompts, greedy)
    gen = ChunkedGeneration(prompts, greedy, chunk_tokens=2)
    while not gen.done:
        gen.step(engine, 0)
    groups, versions = gen.completions()
    assert [g[0].token_ids for g in groups] == [w[0].token_ids for w in whole]
    assert versions == [[0] * 6, [0] * 6]

    # Interrupted: 2 tokens under v0, then a weight update, then the rest under v1.
    gen = ChunkedGeneration(prompts, greedy, chunk_tokens=2)
    gen.step(engine, 0)
    g = torch.Generator().manual_seed(0)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in v0.state_dict().items()}
    v1 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    v1.load_state_dict(new)
    engine.update_weights(new.items())
    engine.finalize_weights()
    while not gen.done:
        gen.step(engine, 1)
    groups, versions = gen.completions()
    assert versions == [[0, 0, 1, 1, 1, 1]] * 2
    for prompt, group in zip(prompts, groups):
        c = group[0]
        head, head_lp = _greedy_oracle(v0, prompt, 2)
        tail, tail_lp = _greedy_oracle(v1, prompt + head, 4)
        assert c.token_ids == head + tail and c.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(c.log_probs, head_lp + tail_lp)) < 1e-4
    assert groups[0][0].token_ids != whole[0][0].token_ids or groups[1][0].token_ids != whole[1][0].token_ids

    # Sampled, n=2 per prompt: the same calls under the same weights give the same tokens.
    sampled = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=7)
    runs = []
    for _ in range(2):
        gen = ChunkedGeneration(prompts, sampled, chunk_tokens=2)
        while not gen.done:
            gen.step(engine, 1)
        runs.append(gen.completions()[0])
    assert [len(gr) for gr in runs[0]] == [2, 2]
    assert [[c.token_ids for c in gr] for gr in runs[0]] == [[c.token_ids for c in gr] for gr in runs[1]]
    assert all(math.isfinite(lp) and lp <= 0 for gr in runs[0] for c in gr for lp in c.log_probs)


def test_stale_groups_are_regenerated_or_dropped(tiny):
    """RolloutWorker.enforce_staleness on a real native engine (one rollout rank)."""
    import dataclasses

    w = rollout_worker(native_engine(tiny), ["async_training.max_staleness=1"])
    prompts = three_prompts()
    batch = w.generate(prompts, t=4)
    assert (batch.batch["token_versions"][batch.batch["response_mask"] > 0] == 3).all()
    # Pretend prompt "b"'s second sample began under version 1: 2 behind version 3 (batch 4).
    batch.batch["token_versions"][3, 0] = 1
    batch.batch["response_mask"][3, 0] = 1
    kept, m = w.enforce_staleness(batch, prompts, t=4)
    assert m["stale_groups"] == 1 and m["regenerated_groups"] == 1 and len(kept) == 6
    assert m["dropped_tokens"] == float(batch.batch["response_mask"][2:4].sum())     # group "b", both samples
    assert sorted(kept.non_tensor_batch["uid"].tolist()) == ["a", "a", "b", "b", "c", "c"]
    assert (kept.batch["token_versions"][kept.batch["response_mask"] > 0] == 3).all()
    w.acfg = dataclasses.replace(w.acfg, stale_samples="drop")
    kept, m = w.enforce_staleness(batch, prompts, t=4)
    assert m["dropped_groups"] == 1 and kept.non_tensor_batch["uid"].tolist() == ["a", "a", "c", "c"]


def test_rollout_ranks_sample_with_rollout_seed(tiny):
    """Disaggregated placement: the rollout ranks' sampling seed is rollout.seed when set, as in
    the colocated loop, never trainer.seed (which would accept rollout.seed and ignore it)."""
    engine = native_engine(tiny)

    def responses(*overrides):
        return rollout_worker(engine, overrides).generate(three_prompts(), t=4).batch["responses"]

    by_rollout_seed = responses("trainer.seed=1", "actor_rollout_ref.rollout.seed=5")
    assert torch.equal(by_rollout_seed, responses("trainer.seed=5"))
    assert not torch.equal(by_rollout_seed, responses("trainer.seed=1"))


def test_rollout_stream_runs_k_batches_ahead_and_resumes_its_buffer(tiny):
    """The rollout ranks' loop (RolloutWorker._run) on a real native engine and a real prompt
    loader, at max_staleness k=2: batch t starts under version max(0, t-1-k), so it is trained at
    staleness min(t-1, k), and the buffer holds k-1 finished batches at each hand-off. At a save
    step (save_freq=2) the hand-off also carries the finished batches behind it; a worker resumed
    from them hands over exactly what the unkilled one did. (k=1 is the end-to-end test's
    schedule, k=0's regeneration test_stale_groups_are_regenerated_or_dropped.)"""
    from megarl.algos.staleness import sample_staleness

    engine, total, k = native_engine(tiny), 5, 2
    w, payloads = stream_worker(engine, k, total, {})
    assert len(payloads) == total + 1 and payloads[-1]["batch"] is None and w.version == total
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        stale = sample_staleness(b.batch["token_versions"], b.batch["response_mask"], t - 1)
        assert (stale == min(t - 1, k)).all(), (t, stale)
        m = b.meta_info["async_metrics"]
        assert m["regenerated_groups"] == 0.0 and m["dropped_tokens"] == 0.0
        if 1 < t < total:
            assert m["buffer_ready"] == k - 1
        assert 0.0 <= m["engine_idle_fraction"] <= 1.0
        # the data position after the batch, or after the finished batches behind it at a save step
        assert payload["loader"]["batch"] == t + len(payload.get("ahead", []))
    assert "ahead" not in payloads[1] and [a[1]["batch"] for a in payloads[2]["ahead"]] == [4]

    # Resume after step 2's checkpoint: handed batch 3, batch 4 ahead, the data position after 4.
    ahead = payloads[2]["ahead"]
    _, resumed = stream_worker(engine, k, total, {"step": 2, "inflight": True, "ahead": ahead,
                                                   "loader": payloads[2]["loader"]})
    assert len(resumed) == 3 and resumed[-1]["batch"] is None
    for a, b in zip(payloads[3:5], resumed[:2]):
        for key in ("responses", "token_versions", "rollout_log_probs"):
            assert torch.equal(a["batch"].batch[key], b["batch"].batch[key]), key
        assert a["loader"] == b["loader"]


def test_rollout_stream_resumes_a_batch_half_generated(tiny):
    """The same loop with partial rollouts in chunks of one token, each update taken after the first
    chunk of the last batch the engine may start (update_at_chunk=1): batch t >= 3 starts under
    version t-3 and takes update t-2 after its first token. Step 2's hand-off carries batch 4 half
    generated; a worker resumed from it continues those responses and hands over exactly what the
    unkilled one did: tokens, log-probs and the version of every token."""
    from megarl.algos.staleness import sample_staleness

    extra = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
             "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
             "async_training.partial_chunk_tokens=1", "async_training.update_at_chunk=1")
    engine, total, k = native_engine(tiny), 5, 2
    w, payloads = stream_worker(engine, k, total, {}, extra)
    assert len(payloads) == total + 1 and payloads[-1]["batch"] is None and w.version == total
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        tv, mask = b.batch["token_versions"], b.batch["response_mask"]
        assert (sample_staleness(tv, mask, t - 1) == [0, 1, 2, 2, 2][t - 1]).all(), (t, tv)
        if t >= 3:
            assert (tv[:, 0] == t - 3).all() and (tv[:, 1:][mask[:, 1:] > 0] == t - 2).all(), (t, tv)
    assert (payloads[4]["batch"].batch["response_mask"].sum(-1) > 1).any(), "no response spans two chunks"

    partial, = payloads[2]["partial"]
    seqs = partial["gens"][0]["seqs"]
    assert payloads[2]["ahead"] == [] and partial["version"] == 1 and partial["chunks"] == 1
    assert all(s["versions"] == [1] for s in seqs) and any(s["finish"] is None for s in seqs)
    assert payloads[2]["loader"]["batch"] == 4
    _, resumed = stream_worker(engine, k, total, {"step": 2, "inflight": True, "ahead": [], "partial": [partial],
                                                   "loader": payloads[2]["loader"]}, extra)
    assert len(resumed) == 3 and resumed[-1]["batch"] is None
    for a, b in zip(payloads[3:5], resumed[:2]):
        for key in ("responses", "token_versions", "rollout_log_probs"):
            assert torch.equal(a["batch"].batch[key], b["batch"].batch[key]), key
        assert a["loader"] == b["loader"]


class _OneCallPerChunk:
    """The built-in engine seen as an engine that cannot pause (as vLLM's and TensorRT-LLM's);
    `samples` records each call's n."""

    def __init__(self, inner):
        self.inner, self.samples = inner, []

    def generate(self, prompts, sampling):
        self.samples.append(sampling.n)
        return self.inner.generate(prompts, sampling)

    def generate_sequences(self, prompts):     # a stale group's regeneration: the contract's whole call
        return self.inner.generate_sequences(prompts)


@pytest.mark.parametrize("pausable", [True, False], ids=["pausable", "one_call_per_chunk"])
def test_the_next_batch_starts_in_the_long_tail_of_the_one_before(tiny, pausable):
    """Partial rollouts with a quarter of the vocabulary as stop tokens: most responses end within a
    chunk, a few run to the limit. With tail_overlap=0.5, once at most half of a batch's samples
    are unfinished the next batch starts beside it, in the same engine calls (`started_in_tail`;
    never with tail_overlap=0), and staleness stays within k. Updates land at fixed chunks
    (update_at_chunk), so the schedule is timing-free and every hand-off's checkpoint
    (save_freq=1), some holding two batches in flight and finished batches behind them, resumes
    to exactly the hand-offs the unkilled worker made."""
    from megarl.algos.staleness import sample_staleness

    extra = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
             "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
             "async_training.partial_chunk_tokens=2", "actor_rollout_ref.rollout.response_length=8",
             "async_training.update_at_chunk=1", "trainer.save_freq=1", "async_training.tail_overlap=0.5")
    engine, total, k, stops = native_engine(tiny), 8, 3, list(range(80))
    if not pausable:
        engine = _OneCallPerChunk(engine)
    _, off = stream_worker(engine, k, total, {}, (*extra, "async_training.tail_overlap=0"), stops)
    assert [p["batch"].meta_info["async_metrics"]["started_in_tail"] for p in off[:-1]] == [0.0] * total
    if not pausable:
        engine.samples.clear()
    w, payloads = stream_worker(engine, k, total, {}, extra, stops)
    assert len(payloads) == total + 1 and payloads[-1]["batch"] is None
    in_tail = [p["batch"].meta_info["async_metrics"]["started_in_tail"] for p in payloads[:-1]]
    assert in_tail[0] == 0.0 and sum(in_tail) >= 3, in_tail
    if not pausable:      # every batch's first chunk is one call of n samples, in the tail or not
        assert sum(n > 1 for n in engine.samples) == total, engine.samples
    lengths = torch.cat([p["batch"].batch["response_mask"].sum(-1) for p in payloads[:-1]])
    assert lengths.min() == 1 and lengths.max() >= 6, lengths          # a long tail, as meant (limit 8)
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        assert (sample_staleness(b.batch["token_versions"], b.batch["response_mask"], t - 1) <= k).all()
    in_flight = [len(p.get("partial") or []) for p in payloads[:-1]]
    assert 2 in in_flight and any(n and p["ahead"] for n, p in zip(in_flight, payloads)), in_flight
    for i in (i for i, n in enumerate(in_flight) if n):
        start = {"step": i, "inflight": True, "ahead": payloads[i]["ahead"], "partial": payloads[i]["partial"],
                 "loader": payloads[i]["loader"]}
        _, resumed = stream_worker(engine, k, total, start, extra, stops)
        assert len(resumed) == total - i and resumed[-1]["batch"] is None
        for a, b in zip(payloads[i + 1:-1], resumed[:-1]):
            for key in ("responses", "token_versions", "rollout_log_probs"):
                assert torch.equal(a["batch"].batch[key], b["batch"].batch[key]), (i, key)
            assert a["loader"] == b["loader"]
            assert a["batch"].meta_info["async_metrics"]["started_in_tail"] == \
                b["batch"].meta_info["async_metrics"]["started_in_tail"]
    # A later batch may finish before the one in flight ahead of it: the checkpoint's batch in
    # flight keeps its place and the finished one takes the place after it.
    i = next(i for i, p in enumerate(payloads[:-1]) if len(p["partial"]) == 1 and p["ahead"])
    state = dict(payloads[i]["partial"][0], t=i + 2)
    w.handed = i + 1
    order = [(j.t, j.batch is None) for j in w._restore_buffer(payloads[i]["ahead"], [state])]
    assert order == [(i + 2, True), *[(i + 3 + n, False) for n in range(len(payloads[i]["ahead"]))]], order


@pytest.mark.parametrize("pausable", [True, False], ids=["pausable", "one_call_per_chunk"])
def test_a_step_takes_the_first_finished_groups_and_leaves_the_tail_to_a_later_one(tiny, pausable):
    """handoff=finished_groups on a long-tailed stream (responses up to 16 tokens, a quarter of
    the vocabulary as stop tokens, k=2), on a pausable engine and one call per chunk: every
    hand-off is the batch size (3 prompt groups x n), taken oldest batch first from the groups that
    are done, so some steps take the next batch's first groups and leave a long response of the
    batch before to a later step (`deferred_groups`), which then trains it; nothing is handed over
    twice or lost (handed + left in the buffer = started). A deferred group may outlive the bound:
    it is regenerated (`regenerated_groups`), so staleness stays within k. With updates at fixed
    chunks every hand-off's checkpoint (every batch held, with what was taken of it) resumes to
    exactly the hand-offs the unkilled worker made."""
    from megarl.algos.staleness import sample_staleness

    extra = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
             "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
             "async_training.partial_chunk_tokens=2", "actor_rollout_ref.rollout.response_length=16",
             "async_training.update_at_chunk=1", "trainer.save_freq=1", "async_training.tail_overlap=0.5",
             "async_training.handoff=finished_groups")
    engine, total, k, stops = native_engine(tiny), 8, 2, list(range(80))
    if not pausable:
        engine = _OneCallPerChunk(engine)
    w, payloads = stream_worker(engine, k, total, {}, extra, stops)
    assert len(payloads) == total + 1 and payloads[-1]["batch"] is None
    metrics = [p["batch"].meta_info["async_metrics"] for p in payloads[:-1]]
    assert all(len(p["batch"]) == 3 * 2 for p in payloads[:-1])
    spans = [m["handoff_batches"] for m in metrics]
    assert max(spans) == 2 and any(m["deferred_groups"] > 0 for m in metrics), metrics
    assert any(m["regenerated_groups"] > 0 for m in metrics), metrics
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        assert (sample_staleness(b.batch["token_versions"], b.batch["response_mask"], t - 1) <= k).all()
    handed, started = 3 * total, 3 * (w.next_t - 1)
    assert handed + sum(j.size - len(j.taken) for j in w.buffer) == started
    # a step after one that deferred groups trains them: groups of an older batch come first
    i = next(i for i, m in enumerate(metrics) if m["deferred_groups"] > 0)
    assert metrics[i + 1]["deferred_groups"] < metrics[i]["deferred_groups"] or metrics[i + 1]["handoff_batches"] == 2
    held = [len(p.get("partial") or []) for p in payloads[:-1]]
    assert max(held) >= 2 and all(p["ahead"] == [] for p in payloads[:-1]), held
    assert any(s["taken"] for p in payloads[:-1] for s in p["partial"]), "no checkpoint held a batch half taken"
    for i in range(total - 1):
        start = {"step": i, "inflight": True, "ahead": [], "partial": payloads[i]["partial"],
                 "loader": payloads[i]["loader"], "next_t": payloads[i]["next_t"]}
        _, resumed = stream_worker(engine, k, total, start, extra, stops)
        assert len(resumed) == total - i and resumed[-1]["batch"] is None
        for a, b in zip(payloads[i + 1:-1], resumed[:-1]):
            for key in ("responses", "token_versions", "rollout_log_probs", "input_ids"):
                assert torch.equal(a["batch"].batch[key], b["batch"].batch[key]), (i, key)
            assert a["loader"] == b["loader"] and a["next_t"] == b["next_t"]
            assert a["batch"].meta_info["async_metrics"] == b["batch"].meta_info["async_metrics"] | {
                k: v for k, v in a["batch"].meta_info["async_metrics"].items() if k == "engine_idle_fraction"}


def test_a_round_ends_the_call_once_a_step_of_finished_groups_can_be_handed_over():
    """The boundary decision of handoff=finished_groups: with 2 groups of an older batch done and
    waiting, the call in flight stops at the boundary where its batch's first group is done (3 =
    the batch size), only once the engine holds the version the step trains after, and not for a
    group already handed over."""
    import dataclasses
    from collections import deque

    from megarl.data.loader import PromptLoader
    from megarl.rollout.partial import ChunkedGeneration
    from megarl.trainer.stream.buffer import Pending

    extra = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
             "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
             "async_training.tail_overlap=0.5", "async_training.handoff=finished_groups")
    w = rollout_worker(None, list(extra))
    loader = PromptLoader([{"prompt_token_ids": p, "index": i} for i, p in enumerate(PROMPTS3 * 2)], 3, seed=2)
    w.p = dataclasses.replace(w.p, train_loader=loader)
    w.signal = TrainerSide({})
    w.depth, w.total, w.handed, w.next_t = 2, 8, 1, 9     # (no batch left to start: no overlap stop)

    def batch(t, finished):
        prompts = loader.next_batch()
        job = Pending(t, prompts, {}, 0, finished=finished)
        w._chunked(job)
        return job
    older, young = batch(2, True), batch(3, False)
    older.taken, older.ready = {0}, {1, 2}
    w.buffer = deque([older, young])
    young.gen = ChunkedGeneration(PROMPTS3, w.sampling, 2)
    stops = {}
    for version in (0, 1):
        w.version = version
        stops[version] = [w._round([young], [left]).stop for left in ([2, 2, 2], [2, 1, 2], [0, 2, 1])]
    assert stops == {0: [False, False, False], 1: [False, False, True]}, stops
    young.taken = {0}                      # its done group was handed over already
    assert not w._round([young], [[0, 2, 1]]).stop
    young.taken, older.ready = set(), {1}  # one group fewer waiting: three are not done yet
    assert not w._round([young], [[0, 2, 1]]).stop


def test_a_pausable_engine_runs_chunks_in_one_call_and_stops_where_asked(tiny):
    """The built-in engine's generate_pausable: never paused it returns what generate returns;
    paused at the second boundary of chunks of 2, running samples hold 4 tokens ("paused") and
    prompts still waiting none. ChunkedGeneration on it makes one engine call per update instead
    of one per chunk, with the same tokens, log-probs and versions as the chunk-by-chunk path under
    greedy decoding (the oracle test above fixes what those are)."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.partial import ChunkedGeneration
    from megarl.rollout.registry import build_rollout
    from transformers import AutoModelForCausalLM

    engine = build_rollout(RolloutConfig(name="native", dtype="float32", max_num_seqs=4), tiny)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict().items())
    engine.finalize_weights()
    prompts = [[5, 17, 42, 8], [3, 3, 9], [7, 8], [11, 12, 13]]
    sp = SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=4, ignore_eos=True)
    whole = engine.generate(prompts, sp)
    asked = []
    never = engine.generate_pausable(prompts, sp, lambda unfinished: asked.append(unfinished) or False, 2)
    assert [[c.token_ids for c in g] for g in never] == [[c.token_ids for c in g] for g in whole] and asked
    # each boundary says how many samples of each prompt still run or wait: all 8 at first, then
    # fewer as the first prompts finish (7 tokens) and the queued ones take their rows
    assert asked[0] == {0: 2, 1: 2, 2: 2, 3: 2} and sum(asked[-1].values()) < 8
    # each prompt's own budget (continued responses with different budgets left share a call)
    capped = engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, budgets=[1, 7, 3, 9])
    assert [[len(c.token_ids) for c in g] for g in capped] == [[1, 1], [7, 7], [3, 3], [7, 7]]
    with pytest.raises(ValueError, match="one count >= 1 per prompt"):
        engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, budgets=[1, 2])
    # each prompt's own number of samples (a new batch's n beside single continued responses):
    # sample j of prompt i is drawn as in a call where every prompt has n (its key is (i, j)),
    # with 4 rows for 6 samples, so the queue waits on rows and groups of different widths
    mixed = engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, samples=[2, 1, 1, 2])
    assert [[c.token_ids for c in g] for g in mixed] == [[c.token_ids for c in g[:k]] for g, k in
                                                         zip(whole, [2, 1, 1, 2])]
    assert all(abs(a - b) < 1e-5 for g, w in zip(mixed, whole) for c, d in zip(g, w)
               for a, b in zip(c.log_probs, d.log_probs))
    for bad in ([2, 1, 1], [2, 0, 1, 1], [3, 1, 1, 1]):
        with pytest.raises(ValueError, match=r"samples: one count in 1\.\.n=2 per prompt"):
            engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, samples=bad)
    calls = iter([False, True])
    out = engine.generate_pausable(prompts, sp, lambda unfinished: next(calls), 2)
    # 4 rows: the first two prompts run (2 samples each), the last two wait in the queue
    assert [[(len(c.token_ids), c.finish_reason) for c in g] for g in out] == \
        [[(4, "paused")] * 2] * 2 + [[(0, "paused")] * 2] * 2
    # and goes on from each sample's response so far (its prompt prefilled once per group): every
    # sample ends as the never-paused call's did, token for token (its step counts the tokens it
    # came with, so it draws what it would have), log-probs within 1e-5; with a repetition
    # penalty and stop tokens too (the penalty counts the response so far)
    for params in (sp, SamplingParams(n=2, max_tokens=7, temperature=0.9, top_k=30, seed=6,
                                      repetition_penalty=1.4, stop_token_ids=[20, 21, 22])):
        calls = iter([False, True])
        first = engine.generate_pausable(prompts, params, lambda unfinished: next(calls), 2)
        before = engine.stats["continued"]
        rest = engine.generate_pausable(prompts, params, lambda unfinished: False, 2,
                                        prefixes=[[c.token_ids for c in g] for g in first])
        assert engine.stats["continued"] - before == sum(bool(c.token_ids) for g in first for c in g) > 0
        full = engine.generate(prompts, params)
        assert [[a.token_ids + b.token_ids for a, b in zip(g, h)] for g, h in zip(first, rest)] == \
            [[c.token_ids for c in g] for g in full]
        assert [[c.finish_reason for c in g] for g in rest] == [[c.finish_reason for c in g] for g in full]
        joined = [x for g, h in zip(first, rest) for a, b in zip(g, h) for x in a.log_probs + b.log_probs]
        assert joined == pytest.approx([x for g in full for c in g for x in c.log_probs], abs=1e-5)
    with pytest.raises(ValueError, match="one response so far per sample"):
        engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, prefixes=[[[1]], [], [], []])
    with pytest.raises(ValueError, match="shorter than max_tokens=7"):
        engine.generate_pausable(prompts, sp, lambda unfinished: False, 2, prefixes=[[[1] * 7, []]] + [[[], []]] * 3)

    class Counting:                                          # counts engine calls; pausable or not
        def __init__(self, inner, pausable: bool):
            self.inner, self.calls = inner, 0
            if pausable:
                self.generate_pausable = self._counted(inner.generate_pausable)
            self.generate = self._counted(inner.generate)

        def _counted(self, fn):
            def call(*a, **k):
                self.calls += 1
                return fn(*a, **k)
            return call

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results, calls = {}, {}
    for way in ("chunks", "pausable"):
        counting = Counting(engine, pausable=way == "pausable")
        gen = ChunkedGeneration(prompts[:2], greedy, chunk_tokens=2)
        boundaries = iter([False, True])                    # an update is due at the second boundary
        version = 0
        while not gen.done:
            if way == "pausable":
                gen.step(counting, version, pause=lambda unfinished: next(boundaries, False))
            else:
                gen.step(counting, version)
            version = 1 if gen.chunks_done == 2 or way == "pausable" else version   # the update lands there
        groups, versions = gen.completions()
        results[way] = (groups, versions)
        calls[way] = counting.calls
    assert calls == {"chunks": 3, "pausable": 2}             # one call per chunk; one per update
    (chunked, v_chunks), (paused, v_paused) = results["chunks"], results["pausable"]
    assert v_paused == v_chunks == [[0, 0, 0, 0, 1, 1]] * 2
    for a, b in zip(chunked, paused):
        assert a[0].token_ids == b[0].token_ids and a[0].finish_reason == b[0].finish_reason == "length"
        # a continued sequence's KV is re-prefilled in one, decoded token by token in the other
        assert max(abs(x - y) for x, y in zip(a[0].log_probs, b[0].log_probs)) < 1e-5


def test_a_resume_refuses_a_buffer_deeper_than_max_staleness():
    """A checkpoint's buffer generated k batches ahead resumes with max_staleness >= k, and is
    refused in one line below that: from the next batch to start where the checkpoint says it
    (batches up to next_t - 1 held at step s need k >= next_t - 2 - s), else from the count of
    batches held."""
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    from megarl.trainer.stream.fit import AsyncRLTrainer

    def check(k, **state):
        t = AsyncRLTrainer.__new__(AsyncRLTrainer)
        t.cfg = load_config(None, [f"async_training.max_staleness={k}"])
        t.ahead, t.partial, t.next_t = [], None, None
        for key, value in state.items():
            setattr(t, key, value)
        t.check_buffer_fits(4)

    check(3, next_t=9)                             # batches 6-8 held at step 4 (5 in the trainer's hands)
    with pytest.raises(ConfigError, match=r"generated 3 batches ahead.*max_staleness >= 3"):
        check(2, next_t=9)
    check(1, next_t=7)
    check(3, ahead=[("batch", {})], partial=[{"t": 7}])     # a checkpoint written before next_t was saved
    with pytest.raises(ConfigError, match=r"holds 2 batch\(es\).*max_staleness >= 3"):
        check(2, ahead=[("batch", {})], partial=[{"t": 7}])
    with pytest.raises(ConfigError, match=r"holds 1 batch\(es\).*max_staleness >= 2"):
        check(1, partial={"t": 6})
