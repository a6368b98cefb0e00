"""A weight update that lands inside the built-in engine's call (async_training.kv_after_update=keep):
the call goes on with the K/V computed so far, every token after the load is drawn from the new
weights over that cache, and each completion says which tokens came after which load
(Completion.weight_epochs), so the stream labels each token with the version that sampled it.

The oracle is transformers: the old model over the prompt and the tokens before the load, then the
new model continuing from the old model's past_key_values, token by token.

    python -m pytest -q tests/test_kv_keep.py
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.stream_parts import stream_worker, tiny  # noqa: F401  (tiny: a fixture)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """The same architecture with other weights: the update the test loads mid-call."""
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("kvkeep") / "qwen2"), "qwen2", seed=11, vocab_size=301,
                        tokenizer=False)


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _load(engine, model) -> None:
    engine.update_weights(model.state_dict().items())
    engine.finalize_weights()


def _kept_cache_log_probs(old, new, prompt: list[int], tokens: list[int], switch: int) -> torch.Tensor:
    """Each token's log-prob when tokens[:switch] were drawn by `old` and the rest by `new`, whose
    steps attend to the K/V `old` computed (the last old token is fed, so cached, by `new`)."""
    with torch.no_grad():
        if switch == 0:
            logits = new(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0]
        elif switch == len(tokens):
            logits = old(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0]
        else:
            first = old(input_ids=torch.tensor([prompt + tokens[:switch - 1]]), use_cache=True)
            rest = new(input_ids=torch.tensor([tokens[switch - 1:-1]]), past_key_values=first.past_key_values)
            logits = torch.cat([first.logits[0], rest.logits[0]])
    logp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:]
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)]


def test_a_load_inside_the_call_keeps_the_cache_and_marks_each_token(tiny, other):  # noqa: F811
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.native.engine import NativeEngine
    old, new = _hf(tiny), _hf(other)
    engine = NativeEngine.from_pretrained(tiny, dtype="float32", max_num_seqs=4)
    prompts = [[5, 17, 42], [3, 3, 9], [7, 8], [11, 12, 13, 14]]
    sp = SamplingParams(n=2, max_tokens=12, seed=4, stop_token_ids=list(range(40)))
    boundaries = [0]

    def pause(unfinished: dict[int, int]) -> bool:
        boundaries[0] += 1
        if boundaries[0] == 3:             # rows have tokens; prompts still wait for rows
            _load(engine, new)
        return False
    before = engine.stats["continued"]
    out = engine.generate_pausable(prompts, sp, pause, 1)
    assert engine.stats["continued"] == before          # nothing prefilled again
    shapes = {"across": 0, "after": 0, "before": 0}
    for prompt, group in zip(prompts, out):
        for c in group:
            epochs = c.weight_epochs or [0] * len(c.token_ids)
            assert len(epochs) == len(c.token_ids) and epochs == sorted(epochs) and set(epochs) <= {0, 1}, epochs
            switch = epochs.index(1) if 1 in epochs else len(epochs)
            shapes["after" if switch == 0 else "before" if switch == len(epochs) else "across"] += 1
            got = torch.tensor(c.log_probs)
            want = _kept_cache_log_probs(old, new, prompt, c.token_ids, switch)
            assert torch.allclose(got, want, atol=1e-4), (prompt, epochs, (got - want).abs().max())
            if 0 < switch < len(epochs) - 1:
                # the check can fail: the new weights over a recomputed cache draw from other log-probs
                redo = _kept_cache_log_probs(old, new, prompt, c.token_ids, 0)
                assert not torch.allclose(got[switch + 1:], redo[switch + 1:], atol=1e-3)
    # samples ran across the load, and prompts admitted after it are the new weights' throughout
    assert shapes["across"] and shapes["after"], shapes


def test_prompts_join_a_running_call_and_draw_from_the_model(tiny):  # noqa: F811
    """join(): a second batch enters the call at a boundary; its samples' log-probs are the model's
    given the prompt and the tokens before them, and a prompt the call's cache cannot hold is
    refused by fits_call (and by the call, if joined anyway)."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.native.engine import NativeEngine
    model = _hf(tiny)
    engine = NativeEngine.from_pretrained(tiny, dtype="float32")
    first, later = [[5, 17, 42], [3, 3, 9]], [[7, 8], [11, 12, 13]]
    sp = SamplingParams(n=2, max_tokens=10, seed=4, stop_token_ids=list(range(40)))
    asked = [0]

    def join():
        asked[0] += 1
        if asked[0] != 2:
            return None
        assert engine.fits_call(later) and not engine.fits_call([list(range(1, 200))])
        return later, [2, 1]
    out = engine.generate_pausable(first, sp, lambda unfinished: False, 1, join=join)
    assert [len(g) for g in out] == [2, 2, 2, 1] and engine.stats["joined"] == 2
    for prompt, group in zip(first + later, out):
        for c in group:
            assert c.token_ids and c.weight_epochs is None
            got = torch.tensor(c.log_probs)
            want = _kept_cache_log_probs(model, model, prompt, c.token_ids, len(c.token_ids))
            assert torch.allclose(got, want, atol=1e-4), (prompt, (got - want).abs().max())
    with pytest.raises(ValueError, match="join: 1 prompts.*do not fit this call"):
        engine.generate_pausable(first, sp, lambda unfinished: False, 1,
                                 join=lambda: ([list(range(1, 200))], [1]))


class _LoadingSide:
    """Stands for the trainer in tests.helpers.stream_parts.stream_worker, but each sync loads
    the next version's weights into the engine (alternating two models), as a real sync does."""

    def __init__(self, engine, models):
        self.engine, self.models, self.syncs = engine, models, -1    # the first sync is version 0's

    def sync(self):
        self.syncs += 1
        _load(self.engine, self.models[self.syncs % 2])
        return {}


EXTRA = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
         "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
         "async_training.partial_chunk_tokens=2", "actor_rollout_ref.rollout.response_length=16",
         "async_training.update_at_chunk=3", "trainer.save_freq=-1", "async_training.tail_overlap=0.5",
         "async_training.handoff=finished_groups")


@pytest.mark.timeout(900)
def test_a_stream_with_kept_caches_labels_each_token_with_its_sampler(tiny, other):  # noqa: F811
    """The long-tailed stream of tests/test_stream_handoff.py with updates that load real weights:
    with keep the updates land inside the calls, every token's version is the number of loads
    before it was drawn, within the bound, and fewer responses are prefilled again than with
    recompute, whose calls stop at every update."""
    from megarl.algos.staleness import sample_staleness
    from megarl.rollout.native.engine import NativeEngine
    total, k = 8, 2
    runs = {}
    for kv in ("recompute", "keep"):
        engine = NativeEngine.from_pretrained(tiny, dtype="float32")
        side = _LoadingSide(engine, [_hf(tiny), _hf(other)])
        w, payloads = stream_worker(engine, k, total, {}, (*EXTRA, f"async_training.kv_after_update={kv}"),
                                    list(range(80)), weight_sync=side)
        assert side.syncs == w.version            # one load per version the engine took
        metrics = [p["batch"].meta_info["async_metrics"] for p in payloads[:-1]]
        runs[kv] = (sum(m["updates_kept_kv"] for m in metrics), sum(m["updates_in_call"] for m in metrics),
                    engine.stats["continued"], payloads)
    kept, stopped, continued, payloads = runs["keep"]
    assert runs["recompute"][:2] == (0, runs["recompute"][1]) and runs["recompute"][1] > 0, runs["recompute"][:3]
    assert kept > 0 and stopped == 0, runs["keep"][:3]
    # the next batch joins the running call (tail_overlap), so no response is prefilled again
    assert continued == 0 < runs["recompute"][2], (continued, runs["recompute"][2])
    assert sum(p["batch"].meta_info["async_metrics"]["joined"] for p in payloads[:-1]) > 0
    mixed = 0
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        versions, mask = b.batch["token_versions"], b.batch["response_mask"] > 0
        assert (sample_staleness(versions, b.batch["response_mask"], t - 1) <= k).all(), t
        assert (versions[mask] <= t - 1).all(), t
        for row, m in zip(versions, mask):
            v = row[m]
            assert (v[1:] >= v[:-1]).all(), v           # a response's versions never go back
            mixed += int(len(v) > 0 and v[0] != v[-1])
    assert mixed, "no response ran across a kept update"
