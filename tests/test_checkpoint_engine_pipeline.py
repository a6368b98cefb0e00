"""The bucket pipeline both transports run (megarl/checkpoint_engine/pipeline.py): the order of
starts and loads with and without overlap, a load error kept while later buckets still move, and
a failed collective aborting the engine's update. Real torch tensors; the "collectives" are
plain objects with wait(), as torch's Work is."""
from __future__ import annotations

import pytest
import torch

from megarl.checkpoint_engine.pipeline import Transfer, run_pipeline


class Work:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def wait(self):
        if self.fail:
            raise RuntimeError(f"collective {self.name} failed")
        self.log.append(f"wait {self.name}")


def pipeline(n, log, fail_load=None, fail_wait=None):
    def start(k):
        log.append(f"start {k}")
        return Transfer(torch.zeros(k + 1), [Work(log, k, fail=k == fail_wait)])

    def load(k, buf):
        log.append(f"load {k}")
        if k == fail_load:
            raise ValueError("bad tensor")
    return start, load


@pytest.mark.parametrize("overlap", [True, False])
def test_order_and_bytes(overlap):
    log = []
    start, load = pipeline(3, log)
    error, wire = run_pipeline([0, 1, 2], start, load, overlap=overlap, abort=lambda: log.append("abort"))
    assert error is None and wire == (1 + 2 + 3) * 4
    if overlap:     # bucket k+1 is posted before bucket k loads
        assert log == ["start 0", "wait 0", "start 1", "load 0", "wait 1", "start 2", "load 1", "wait 2", "load 2"]
    else:
        assert log == ["start 0", "wait 0", "load 0", "start 1", "wait 1", "load 1", "start 2", "wait 2", "load 2"]


def test_load_error_is_kept_and_later_buckets_still_move():
    log = []
    start, load = pipeline(3, log, fail_load=0)
    error, _ = run_pipeline([0, 1, 2], start, load, overlap=True, abort=lambda: log.append("abort"))
    assert isinstance(error, ValueError) and "abort" not in log
    assert [x for x in log if x.startswith("wait")] == ["wait 0", "wait 1", "wait 2"]
    assert [x for x in log if x.startswith("load")] == ["load 0"]


def test_failed_collective_aborts_and_raises():
    log = []
    start, load = pipeline(3, log, fail_wait=1)
    with pytest.raises(RuntimeError, match="collective 1 failed"):
        run_pipeline([0, 1, 2], start, load, overlap=True, abort=lambda: log.append("abort"))
    assert log[-1] == "abort" and "load 1" not in log
