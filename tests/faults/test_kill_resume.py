"""SIGKILL of a whole run at a step, a save and a weight sync (sync and async trainers): each
resume continues bitwise (CPU fp32) as the run that was never killed, metrics and weights."""
import pytest

from megarl.trainer.metrics import read_metrics
from tests.faults.conftest import STEPS
from tests.helpers.training_runs import stable, step_digests


def check_chain(chain):
    assert chain["rc"] == 0, chain["out"][-3000:]
    previous = None
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
    ref = {r["step"]: r for r in read_metrics(str(chain["ref"]))}
    got = {r["step"]: r for r in read_metrics(str(chain["run"]))}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert stable(got[step]) == stable(ref[step]), step
    # The weights and optimizer state after the last step, byte for byte.
    last = f"global_step_{STEPS}"
    assert step_digests(chain["run"] / last) == step_digests(chain["ref"] / last)


@pytest.mark.timeout(900)
def test_sync_trainer_survives_every_kill_point(sync_chain):
    check_chain(sync_chain)


@pytest.mark.timeout(900)
def test_async_trainer_survives_every_kill_point(async_chain):
    check_chain(async_chain)
