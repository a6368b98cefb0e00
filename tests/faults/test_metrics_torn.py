"""A kill in the middle of a metrics.jsonl write (a torn last line): the resume works and the line
is dropped with a notice naming it, so no later resume fails on it with a JSONDecodeError."""
import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.faults.conftest import STEPS, TORN


@pytest.mark.timeout(1200)
def test_torn_metrics_line_is_dropped_with_a_notice(sync_chain):
    out = sync_chain["out"]
    assert sync_chain["rc"] == 0, out[-3000:]
    notice = [line for line in out.splitlines() if "metrics.jsonl: not a complete JSON record" in line]
    assert len(notice) == 1 and TORN[:40] in notice[0], out[-3000:]
    text = (sync_chain["run"] / "metrics.jsonl").read_text()
    assert TORN not in text and text.endswith("\n")
    assert [r["step"] for r in read_metrics(str(sync_chain["run"]))] == list(range(1, STEPS + 1))
