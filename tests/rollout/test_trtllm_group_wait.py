"""The rollout TP group's followers wait for the leader (its engine start-up, every generate)
longer than the launcher's collective timeout allows, on real gloo ranks."""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from megarl.rollout.trtllm.comm import Group
from tests.distributed import run_ranks

SHORT = 1.5          # the launcher's collective timeout in this test (600 s for NCCL in real runs)
LEADER_BUSY = 4.0    # the leader's start-up or generate(), longer than SHORT


def wait_for_a_slow_leader(rank: int, world: int):
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=SHORT))
    comm = Group(dist.group.WORLD)           # the engine's TP group: here, the whole world
    comm.barrier()
    if comm.rank == 0:
        time.sleep(LEADER_BUSY)
    started = time.monotonic()
    got = comm.broadcast({"tokens": [1, 2, 3]} if comm.rank == 0 else None)
    return got, time.monotonic() - started


def test_followers_outlast_a_leader_slower_than_the_collective_timeout():
    """Before the fix the follower's broadcast_object_list ran on the TP group itself and died
    after SHORT seconds ("Timed out waiting ..."), killing every TP >= 2 rollout group."""
    results = run_ranks(2, wait_for_a_slow_leader, timeout=120)
    assert [r[0] for r in results] == [{"tokens": [1, 2, 3]}] * 2
    assert results[1][1] > SHORT, "the follower really waited past the collective timeout"
