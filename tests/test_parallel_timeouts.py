"""Every process group megarl creates waits trainer.collective_timeout_s for its peers, not torch's
or megatron's 30-minute default: a stopped rank must fail the others within the configured time."""
from __future__ import annotations

import datetime

import pytest

from tests.distributed import run_ranks

TIMEOUT_S = 7.0


def _group_timeouts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.parallel import state
    from megarl.job.ranks import _rollout_tp_group
    state.init_distributed(TIMEOUT_S)
    state.init_model_parallel(tp=2, pp=1)          # megatron's TP, DP, PP, CP, EP, ... groups
    _rollout_tp_group(world, rank, 2)                # the rollout's tensor-parallel blocks
    got = {}
    for pg, (backend, _) in dist.distributed_c10d._world.pg_map.items():
        name = dist.distributed_c10d._world.pg_names.get(pg, "?")
        desc = getattr(pg, "group_desc", name)
        got[f"{desc}/{name}"] = pg._get_backend(torch.device("cpu")).options._timeout
    return got


@pytest.mark.timeout(300)
def test_every_group_gets_the_collective_timeout():
    for got in run_ranks(2, _group_timeouts):
        assert len(got) > 10, got                      # the default group, megatron's and the rollout's
        wrong = {name: t for name, t in got.items() if t != datetime.timedelta(seconds=TIMEOUT_S)}
        assert not wrong, f"groups that do not wait trainer.collective_timeout_s={TIMEOUT_S:g}s: {wrong}"
