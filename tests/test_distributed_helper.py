"""The spawn helper itself, on real gloo: results come back per rank; a failing rank is reported."""
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
