"""The stream under the engine cost model (megarl/rollout/cost_model.py), one process: the rollout
ranks' loop with handoff=finished_groups on a long-tailed stream, its engine paced like a GPU,
hands over exactly what it hands over unpaced, and the regime's events happen in it and are
counted: steps of two batches' groups, deferred groups, stale groups regenerated, updates landing
inside a pausable call, updates waited for with the buffer full, decode steps paced.

    python -m pytest -q tests/test_stream_paced.py
"""
from __future__ import annotations

import sys

import torch

from megarl.rollout.cost_model import CostModelConfig, pace
from tests.helpers.stream_parts import native_engine, stream_worker, tiny  # noqa: F401  (tiny: a fixture)

EXTRA = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
         "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
         "async_training.partial_chunk_tokens=2", "actor_rollout_ref.rollout.response_length=16",
         "async_training.update_at_chunk=1", "trainer.save_freq=1", "async_training.tail_overlap=0.5",
         "async_training.handoff=finished_groups")


def test_paced_stream_hands_over_what_the_unpaced_one_does_and_reaches_the_regime(tiny, monkeypatch):  # noqa: F811
    from megarl.trainer.stream.worker import RolloutWorker
    total, k, stops = 8, 2, list(range(80))
    full = []                 # updates waited for in serve(): nothing in flight and no room to start one
    take = RolloutWorker._take_update

    def counted_take(self):
        full.append(sys._getframe(1).f_code.co_name == "serve")
        return take(self)
    monkeypatch.setattr(RolloutWorker, "_take_update", counted_take)
    _, plain = stream_worker(native_engine(tiny), k, total, {}, EXTRA, stops)
    engine = pace(native_engine(tiny), CostModelConfig(enable=True, decode_s=2e-3, prefill_token_s=1e-4))
    pausable, paused_calls = engine.generate_pausable, []

    def counted(prompts, sampling, pause, every, *args, **kwargs):
        answers = []
        out = pausable(prompts, sampling, lambda left: answers.append(pause(left)) or answers[-1], every, *args,
                       **kwargs)
        paused_calls.append(any(answers))
        return out
    engine.generate_pausable = counted
    _, paced = stream_worker(engine, k, total, {}, EXTRA, stops)
    assert len(paced) == len(plain) == total + 1
    for a, b in zip(plain[:-1], paced[:-1]):
        for key in ("responses", "token_versions", "rollout_log_probs", "input_ids"):
            assert torch.equal(a["batch"].batch[key], b["batch"].batch[key]), key
    metrics = [p["batch"].meta_info["async_metrics"] for p in paced[:-1]]
    counts = {"two-batch steps": sum(m["handoff_batches"] == 2 for m in metrics),
              "deferred groups": sum(m["deferred_groups"] for m in metrics),
              "regenerated groups": sum(m["regenerated_groups"] for m in metrics),
              "updates inside a call": sum(paused_calls), "waits with the buffer full": sum(full),
              "decode steps paced": engine.stats["decode_steps"]}
    assert all(v > 0 for v in counts.values()), counts
    assert engine.stats["paced_owed_s"] > 0 and "paced_s" in engine.stats
    # each hand-off logs the model's seconds per kind since the last one; the regenerations are
    # booked as their own kind, and the hand-offs' sums never exceed the engine's totals
    split = [p["batch"].meta_info["rollout_timing"] for p in paced[:-1]]
    assert not any(k.startswith("paced_") for p in plain[:-1] for k in p["batch"].meta_info["rollout_timing"])
    for kind in ("decode", "prefill_prompts", "prefill_continued", "regenerate"):
        logged = sum(t.get(f"paced_{kind}", 0.0) for t in split)
        assert 0 < logged <= engine.stats[f"paced_s/{kind}"] + 1e-9, (kind, logged)
