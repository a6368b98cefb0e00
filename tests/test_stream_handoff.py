"""The hand-off without stopping the shared call (handoff=finished_groups on the built-in engine):
the engine reports each sample as it finishes, before the next chunk boundary's pause(), and the
stream hands finished groups over at that boundary while the call goes on with its KV cache, so
the unfinished responses are not prefilled again. Tokens, log-probs and versions stay exact.

    python -m pytest -q tests/test_stream_handoff.py
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.stream_parts import native_engine, stream_worker, tiny  # noqa: F401  (tiny: a fixture)

EXTRA = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
         "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
         "async_training.partial_chunk_tokens=2", "actor_rollout_ref.rollout.response_length=16",
         "async_training.update_at_chunk=3", "trainer.save_freq=-1", "async_training.tail_overlap=0.5",
         "async_training.handoff=finished_groups")


def test_a_pausable_call_reports_each_sample_before_the_boundary_that_follows_it(tiny):  # noqa: F811
    from megarl.rollout.base import SamplingParams
    engine = native_engine(tiny)
    prompts = [[5, 17, 42], [3, 3, 9], [7, 8]]
    sp = SamplingParams(n=3, max_tokens=12, seed=4, stop_token_ids=list(range(60)))
    plain = engine.generate_pausable(prompts, sp, lambda left: False, 2)
    reported: dict[tuple[int, int], object] = {}
    counts = []

    def pause(unfinished: dict[int, int]) -> bool:
        # every sample not counted unfinished here has been reported already
        assert sum(3 - unfinished.get(i, 0) for i in range(3)) == len(reported), (unfinished, sorted(reported))
        counts.append(len(reported))
        return False
    out = engine.generate_pausable(prompts, sp, pause, 2, finished=lambda i, j, c: reported.setdefault((i, j), c))
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in plain]
    assert reported == {(i, j): out[i][j] for i in range(3) for j in range(3)}
    assert counts[0] < counts[-1] < 9 and len(set(counts)) > 2, counts   # samples finished at several boundaries
    # a pausing answer returns the rest "paused", and reports none of them
    reported.clear()
    stopped = engine.generate_pausable(prompts, sp, lambda left: len(reported) >= 2, 2,
                                       finished=lambda i, j, c: reported.setdefault((i, j), c))
    paused = [(i, j) for i, g in enumerate(stopped) for j, c in enumerate(g) if c.finish_reason == "paused"]
    assert paused and not set(paused) & set(reported) and len(reported) + len(paused) == 9


def _oracle_log_probs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every response token's log-prob under `model` given its prompt and the response before it,
    beside the rollout's, over the response mask."""
    got, want = [], []
    for row in range(len(batch)):
        prompt = list(batch.non_tensor_batch["prompt_token_ids"][row])
        mask = batch.batch["response_mask"][row] > 0
        response = batch.batch["responses"][row][mask].tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        at = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        want.append(logp[at, torch.tensor(response)])
        got.append(batch.batch["rollout_log_probs"][row][mask])
    return torch.cat(got), torch.cat(want)


@pytest.mark.timeout(900)
def test_finished_groups_leave_inside_the_call_with_exact_log_probs_and_versions(tiny):  # noqa: F811
    """A long-tailed stream (responses of 1 to 16 tokens, chunks of 2, k = 2): hand-offs happen
    inside a call that goes on, and every handed-over token's log-prob is the model's given its
    prompt and the tokens before it (the KV cache the call kept is the one it would rebuild), its
    version within the bound, each batch's groups handed over once."""
    from transformers import AutoModelForCausalLM

    from megarl.algos.staleness import sample_staleness
    total, k = 8, 2
    w, payloads = stream_worker(native_engine(tiny), k, total, {}, EXTRA, list(range(80)))
    assert len(payloads) == total + 1 and payloads[-1]["batch"] is None
    metrics = [p["batch"].meta_info["async_metrics"] for p in payloads[:-1]]
    inside = sum(m["handoff_in_call"] for m in metrics)
    # the last step's hand-off ends the call (nothing after it is needed): the others may go on
    assert 0 < inside <= total - 1 and metrics[-1]["handoff_in_call"] == 0, metrics
    assert any(m["handoff_batches"] == 2 for m in metrics) and any(m["deferred_groups"] for m in metrics), metrics
    assert sum(m["updates_in_call"] for m in metrics) > 0, metrics     # the calls still stop for updates
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for t, payload in enumerate(payloads[:-1], start=1):
        b = payload["batch"]
        assert (sample_staleness(b.batch["token_versions"], b.batch["response_mask"], t - 1) <= k).all(), t
        assert (b.batch["token_versions"][b.batch["response_mask"] > 0] <= t - 1).all(), t
        got, want = _oracle_log_probs(model, b)      # (the weights stay version 0's: stream_parts.TrainerSide)
        assert torch.allclose(got, want, atol=1e-4), (t, (got - want).abs().max())
    handed = sum(len(p["batch"]) for p in payloads[:-1]) // w.cfg.rollout.n
    assert handed == 3 * total
