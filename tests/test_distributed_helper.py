"""The spawn helper itself, on real gloo: results come back per rank; a failing rank is reported;
the ranks see the caller's environment and working directory at the call."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _allreduce(rank, world):
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def test_gloo_allreduce_and_failure_reporting():
    assert run_ranks(2, _allreduce) == [3.0, 3.0]
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(2, _fails_on_one)


def _sees_the_caller(rank, world):
    import os
    return os.environ.get("MEGARL_RANKS_CALLER"), os.getcwd()


def test_ranks_see_the_callers_environment_and_directory_of_now(monkeypatch, tmp_path):
    """The ranks are forked by a server started at the first call; what the caller set after that
    (environment, working directory) still reaches them, as it reaches a spawned process."""
    assert run_ranks(1, _allreduce) == [1.0]
    monkeypatch.setenv("MEGARL_RANKS_CALLER", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(2, _sees_the_caller) == [("set after the server started", str(tmp_path))] * 2


def _total(rank, world, tensors):
    return float(sum(t.sum() for t in tensors))


def test_arguments_holding_hundreds_of_tensors_reach_every_rank():
    """Tensors travel by value: as shared-memory descriptors, 300 of them would exceed what a
    forkserver passes to one process."""
    tensors = [torch.full((4,), float(i)) for i in range(300)]
    assert run_ranks(2, _total, (tensors,)) == [4.0 * sum(range(300))] * 2
