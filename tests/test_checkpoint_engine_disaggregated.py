"""The disaggregated transport on 4 real gloo ranks: ranks 0-1 hold megatron-layout shards (cut
from an HF checkpoint by megarl's own HF -> megatron converter, the layout ActorWorker holds;
megatron-core itself is not started because its parallel_state would span all four ranks),
ranks 2-3 run native engines. Trainer TP 2 x PP 1 feeds one engine at rollout TP 2; trainer
TP 1 x PP 2 feeds two engines at rollout TP 1. After each sync every engine element equals the
HF tensors; changed weights arrive in full; a failure in one engine mid-sync raises on all four
ranks, every engine refuses to generate, and the next sync recovers."""
from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from tests.helpers.checkpoint_engine import PROMPTS, Faulty, engine_mismatch
from tests.distributed import run_ranks

TRAINERS, ENGINES = [0, 1], [2, 3]


def shards_of(full: dict, spec, tp: int, pp: int, t: int, p: int) -> dict:
    from megarl.checkpoint_engine.plan import stage_names
    from megarl.models.convert import hf_to_megatron
    return {n: hf_to_megatron(n, full, spec, t, tp) for n in stage_names(spec, pp, p)}


def check_disaggregated(rank, world, path):
    import torch.distributed as dist

    from megarl.checkpoint_engine import WeightSyncError
    from megarl.checkpoint_engine.distributed import (DisaggregatedGroups, DisaggregatedReceiver,
                                                      DisaggregatedSender)
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.parallel.bridge import Bridge, job_store
    from megarl.rollout.base import SamplingParams
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.native import NativeEngine, TPComm

    store, _, _ = job_store(120)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world)
    everyone = Bridge(store, "world", range(world), rank)      # the transport's groups: bridges, as in a run
    ckpt = HFCheckpoint(path)
    spec = ckpt.spec()
    full = {n: ckpt.read_full(n) for n in ckpt.names()}
    out = {}
    for tp, pp, rtp in ((2, 1, 2), (1, 2, 1)):
        trainer_rank = (lambda t, d, p: t) if tp == 2 else (lambda t, d, p: p)
        groups = DisaggregatedGroups.create(tp, pp, trainer_rank, ENGINES, store, rank, everyone, tag=f"{tp}x{pp}")
        engine_group = dist.new_group(ENGINES) if rtp == 2 else None    # every rank creates every group
        weights = {n: t.clone() for n, t in full.items()}
        r = {}
        if rank in TRAINERS:
            t, p = (rank, 0) if tp == 2 else (0, rank)

            def source():
                return ShardSource(spec, tp, pp, t, p, 0, shards_of(weights, spec, tp, pp, t, p))
            side = DisaggregatedSender(source(), groups, bucket_bytes=100 << 10)
        else:
            engine = NativeEngine(read_hf_config(path), comm=TPComm(engine_group if rtp == 2 else None))
            side = DisaggregatedReceiver(engine, spec, groups, torch.float32, bucket_bytes=100 << 10)
        r["metrics"] = side.sync()
        if rank in ENGINES:
            r["exact"] = engine_mismatch(engine, weights)
            r["buckets"] = len(side.plan.buckets)
        # Change every weight, cut new shards, sync: everything new must arrive.
        for n in weights:
            weights[n] += 0.01 * (1 + torch.rand(weights[n].shape, generator=torch.Generator().manual_seed(len(n))))
        if rank in TRAINERS:
            side.src = source()
        side.sync()
        if rank in ENGINES:
            r["exact_after"] = engine_mismatch(engine, weights)
        # A failure in one engine (rank 3) part-way through.
        faulty = Faulty(engine, at=2) if rank == 3 else None
        try:
            side.sync()
            r["failure"] = "no error"
        except WeightSyncError as err:
            r["failure"] = str(err)
        if faulty:
            faulty.restore()
        if rank in ENGINES:
            try:
                engine.generate(PROMPTS, SamplingParams(max_tokens=3, seed=0))
                r["refused"] = "generated"
            except RuntimeError as err:
                r["refused"] = str(err)
        side.sync()
        if rank in ENGINES:
            r["recovered"] = engine_mismatch(engine, weights)
            r["generates"] = len(engine.generate(PROMPTS, SamplingParams(max_tokens=3, seed=0)))
        out[(tp, pp, rtp)] = r
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("disagg") / "qwen2"), "qwen2", seed=4, vocab_size=301,
                        tokenizer=False)


@pytest.mark.timeout(300)
def test_disaggregated_transport(small):
    ranks = run_ranks(4, check_disaggregated, (small,))
    for key in ranks[0]:
        for rank, out in enumerate(ranks):
            r = out[key]
            assert r["metrics"]["weight_sync/gb"] > 0
            assert "weight sync failed" in r["failure"], (key, rank, r["failure"])
            if rank in ENGINES:
                assert r["buckets"] > 2
                assert r["exact"] == (0.0, []) and r["exact_after"] == (0.0, []), (key, rank)
                assert "did not receive a complete weight update" in r["refused"], (key, rank)
                assert r["recovered"] == (0.0, []) and r["generates"] == len(PROMPTS), (key, rank)
        assert "on this rank" in ranks[3][key]["failure"] and "on another rank" in ranks[0][key]["failure"]
