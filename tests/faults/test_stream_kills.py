"""The stream of finished groups under SIGKILL, run under the engine cost model (its decode steps
and prefills sleep what the built-in engine's take on an H100, megarl/rollout/cost_model.py): the
regime the stream is built for, where groups wait past the staleness bound and are regenerated,
updates land inside calls with their K/V kept (kv_after_update=keep, as the paced benchmark's
stream runs), the next batch joins the running call and hand-offs happen inside calls. Each resume
continues bitwise as the run never killed, and each of those events is counted in the reference
run, so every assertion about them is reached. (This schedule never waits with the buffer full;
tests/test_stream_paced.py counts those waits.)

    python -m pytest -q tests/faults/test_stream_kills.py
"""
import pytest

from megarl.trainer.checkpoints import checkpointing
from tests.faults.conftest import _chain, _reference, check_same_as_reference
from tests.faults.runs import async_overrides

PACED = ("actor_rollout_ref.rollout.cost_model.enable=true", "actor_rollout_ref.rollout.cost_model.scale=20")


def groups_overrides(model_dir, run_dir, steps=5, *extra):
    """async_overrides with every step made of the first finished prompt groups (handoff=finished_groups),
    one batch ahead, sampled at temperature 1.5 so that response lengths spread (2 to 7 tokens),
    each update taken after the second chunk (so that a group waits past the bound) inside the
    engine's call, paced."""
    return async_overrides(model_dir, run_dir, steps, "async_training.handoff=finished_groups",
                           "async_training.max_staleness=1", "actor_rollout_ref.rollout.temperature=1.5",
                           "async_training.update_at_chunk=1", "async_training.kv_after_update=keep", *PACED, *extra)


@pytest.mark.timeout(900)
def test_a_paced_stream_of_finished_groups_survives_kills(addition_model_dir, tmp_path):
    """handoff=finished_groups, two rollout DP ranks: a step takes the next batch's first finished
    groups where the batch before it has a long response left, which a later step trains. Killed
    with a rollout rank inside its stream, then at a weight sync, each resume continues bitwise
    as the run never killed: the checkpoints hold every batch of the buffer, with the groups
    already handed over."""
    reference = _reference(addition_model_dir, tmp_path, groups_overrides)
    chain = _chain(addition_model_dir, tmp_path, groups_overrides, reference,
                   [("pause@stream:5:2", 2), ("pause@sync:5", 4)])
    assert chain["rc"] == 0, chain["out"][-3000:]
    for kill in chain["kills"]:
        assert kill["left"] == [] and kill["lock_free"] and kill["pointer"] == str(kill["resumes_from"]), kill
    ref = check_same_as_reference(chain)
    # the regime, counted over the reference run's steps: each count is what an assertion below
    # (or check_same_as_reference's comparison of it) is about
    counts = {key: sum(ref[t][f"async/{key}"] > 0 for t in ref) for key in
              ("deferred_groups", "regenerated_groups", "updates_kept_kv", "handoff_in_call", "joined")}
    counts["two-batch steps"] = sum(ref[t]["async/handoff_batches"] == 2 for t in ref)
    assert all(counts.values()), counts
    # deferred groups come back: a step after one that deferred trains an older batch's groups
    deferred = [t for t in ref if ref[t]["async/deferred_groups"] > 0 and t + 1 in ref]
    assert any(ref[t + 1]["async/deferred_groups"] < ref[t]["async/deferred_groups"]
               or ref[t + 1]["async/handoff_batches"] == 2 for t in deferred), ref
    # staleness within the bound at every step (regenerated groups included), none lost: every
    # step trains a full batch of groups
    assert all(ref[t]["async/staleness_max"] <= 1 for t in ref), ref
    saved = [checkpointing.read_trainer_state(str(chain["ref"] / f"global_step_{s}")) for s in (2, 4)]
    assert any(state["buffer_partial"] for state in saved)
    assert all(state["buffer_next_t"] >= s + 2 for state, s in zip(saved, (2, 4)))
    assert "paced under the cost model" in chain["ref_out"], chain["ref_out"][-2000:]
