"""SIGKILL of a whole run at a step, a save, a metrics record (sync) and a weight sync (sync and async trainers): each
resume continues bitwise (CPU fp32) as the run that was never killed, metrics and weights."""
import pytest
import torch

from megarl.trainer.checkpoints import checkpointing
from tests.faults.conftest import STEPS, check_same_as_reference


def check_chain(chain) -> dict:
    assert chain["rc"] == 0, chain["out"][-3000:]
    # the first kill's launch resumed from the stopped launch's save (sync chain, conftest.py)
    previous = chain["stop"]["pointer"] if chain["stop"] else None
    for kill in chain["kills"]:
        assert kill["left"] == [], f"{kill['fault']}: left {kill['left']}"
        assert kill["lock_free"], kill["fault"]
        assert kill["pointer"] == str(kill["resumes_from"]), kill
        if previous is not None:     # the killed launch itself resumed from the previous kill's checkpoint
            assert f"at step {previous}" in kill["out"], kill["out"][-2000:]
        previous = kill["resumes_from"]
    # The save killed half-way left only its .tmp directory, removed by the next launch.
    assert "global_step_4.tmp" in chain["kills"][1]["dirs"] and "global_step_4" not in chain["kills"][1]["dirs"]
    assert "removed an incomplete save: global_step_4.tmp" in chain["kills"][2]["out"]
    assert "at step 4" in chain["out"]
    return check_same_as_reference(chain)


@pytest.mark.timeout(1200)
def test_sync_trainer_survives_every_kill_point(sync_chain):
    check_chain(sync_chain)
    # Killed once step 4's checkpoint was complete and before its metrics record: the pointer named
    # step 4 while the record was missing; the resume from step 4 wrote it (check_chain: the same
    # records as the reference run's).
    record = next(kill for kill in sync_chain["kills"] if kill["fault"] == "pause@record:4")
    assert record["pointer"] == "4" and 3 in record["logged"] and 4 not in record["logged"], record


@pytest.mark.timeout(900)
def test_async_trainer_survives_every_kill_point(async_chain):
    """Two batches ahead on two rollout DP ranks, updates landing after the first one-token chunk
    (tests/faults/runs.py)."""
    ref = check_chain(async_chain)
    # The first kill met the second rollout rank in its stream with two batches in flight: batch 5
    # started beside the last responses of batch 4 (async/started_in_tail, checked below).
    assert async_chain["kills"][0]["reached"].startswith("stream:5:2:"), async_chain["kills"][0]["reached"]
    # Step 2's checkpoint, which both later kills resumed from: batch 3 handed over, batch 4 in flight,
    # one token per response sampled under version 1, the update to version 2 taken after that chunk.
    # The killed run's first launch wrote the same one as the reference run.
    saved = [checkpointing.read_trainer_state(str(root / "global_step_2"))
             for root in (async_chain["ref"], async_chain["run"])]
    partial, = saved[0]["buffer_partial"]
    assert saved[0]["buffer_ahead"] == [] and partial["version"] == 1 and partial["chunks"] == 1
    assert len(partial["gens"]) == 2                 # each rollout DP rank's half, 4 prompts x 4
    seqs = [s for gen in partial["gens"] for s in gen["seqs"]]
    assert [len(gen["seqs"]) for gen in partial["gens"]] == [16, 16]
    assert all(s["tokens"] and s["versions"] == [1] for s in seqs)
    assert any(s["finish"] is None for s in seqs), "no response was left half done"
    assert [p["gens"] for p in saved[0]["buffer_partial"]] == [p["gens"] for p in saved[1]["buffer_partial"]]
    assert torch.equal(saved[0]["inflight_batch"].batch["responses"], saved[1]["inflight_batch"].batch["responses"])
    # Batch t trains at version t-1; from batch 3 on, its oldest tokens are 2 versions old and
    # responses span the versions before and after the update; from batch 2 on, most batches
    # start in the tail of the one before (which do depends on the sampled lengths).
    assert [ref[t]["async/staleness_max"] for t in range(1, STEPS + 1)] == [0, 1, 2, 2, 2]
    assert all(ref[t]["async/mixed_version_fraction"] > 0 for t in range(3, STEPS + 1))
    in_tail = [ref[t]["async/started_in_tail"] for t in range(1, STEPS + 1)]
    assert in_tail[0] == 0 and sum(in_tail[1:]) >= 3, in_tail

