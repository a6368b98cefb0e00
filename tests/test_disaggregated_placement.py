"""Disaggregated placement on 3 real gloo ranks through megarl's own setup (setup_ranks):
ranks 0-1 train (megatron TP 2, its groups over those two only), rank 2 runs a native engine.
A real megatron actor's weights cross to the engine over the checkpoint engine's distributed
transport; the update signal is seen by polling, without blocking; a sync that fails part-way on the
engine raises on every rank and leaves the engine
on its previous weights, generating; the next sync brings the new ones."""
from __future__ import annotations

import pytest


def check_placement(rank, world, path):
    import torch
    import torch.distributed as dist

    from megarl.checkpoint_engine import WeightSyncError
    from megarl.checkpoint_engine.distributed import DisaggregatedReceiver, DisaggregatedSender
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.experiment import load_config
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.rollout.base import SamplingParams
    from megarl.job.ranks import destroy, setup_ranks
    from tests.helpers.checkpoint_engine import PROMPTS, Faulty, actor_at, engine_mismatch, native_engine, perturb

    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=3",
                             "actor_rollout_ref.rollout.placement=disaggregated", "trainer.device=cpu",
                             "actor_rollout_ref.rollout.disaggregated_ranks=1",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                             "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    ranks = setup_ranks(cfg)
    r = {"role": ranks.role, "side_world": dist.get_world_size(), "side_rank": dist.get_rank(),
         "global": ranks.global_rank}
    if ranks.role == "trainer":
        from megatron.core import parallel_state as ps
        r["megatron"] = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                         dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
        actor = actor_at(path, 2, 1)
        side = DisaggregatedSender(ShardSource.from_actor(actor), ranks.sync_groups, bucket_bytes=100 << 10)
    else:
        engine = native_engine(path, None)
        spec = HFCheckpoint(path).spec()
        side = DisaggregatedReceiver(engine, spec, ranks.sync_groups, torch.float32, bucket_bytes=100 << 10,
                                     keep_previous=True)

    def export():       # the actor's HF tensors, on every rank of both sides
        mine = {n: t.clone() for n, t in actor.hf_tensors()} if ranks.role == "trainer" else None
        return ranks.world_group.broadcast_object(mine if ranks.global_rank == 0 else None, src=0)

    from megarl.trainer.stream.messages import UpdateSignal
    signal = UpdateSignal(ranks)
    if ranks.role == "rollout":
        r["signal_before"] = signal.arrived(1)      # the trainer sends only after this sync
    side.sync()
    if ranks.global_rank == 0:
        signal.send(1)
    old = export()                                  # after the send on rank 0
    if ranks.role == "rollout":
        r["signal_after"] = (signal.arrived(1), signal.arrived(2), signal.take(1))
    if ranks.role == "rollout":
        r["first"] = engine_mismatch(engine, old)
        r["buckets"] = len(side.plan.buckets)
        before = engine.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    if ranks.role == "trainer":
        perturb(actor)
    new = export()
    faulty = Faulty(engine, at=2) if ranks.role == "rollout" else None
    try:
        side.sync()
        r["failure"] = "no error"
    except WeightSyncError as err:
        r["failure"] = str(err)
    if ranks.role == "rollout":
        faulty.restore()
        r["kept_old"] = engine_mismatch(engine, old)
        r["same_output"] = engine.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0)) == before
    side.sync()
    if ranks.role == "rollout":
        r["recovered"] = engine_mismatch(engine, new)
    destroy(ranks)
    return r


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("placement") / "qwen2"), "qwen2", seed=5, vocab_size=301)


@pytest.mark.timeout(300)
def test_disaggregated_placement_and_failed_sync_keeps_old_weights(small):
    from tests.distributed import run_ranks
    out = run_ranks(3, check_placement, (small,))
    assert [o["role"] for o in out] == ["trainer", "trainer", "rollout"]
    assert [(o["side_world"], o["side_rank"], o["global"]) for o in out] == [(2, 0, 0), (2, 1, 1), (1, 0, 2)]
    for o in out[:2]:
        assert o["megatron"] == (2, 1, [0, 1])            # megatron's groups cover the trainer ranks only
    for o in out:
        assert "weight sync failed" in o["failure"], o["failure"]
    assert "on this rank" in out[2]["failure"] and "reloaded its previous weights" in out[2]["failure"]
    assert "on another rank" in out[0]["failure"]
    e = out[2]
    assert e["signal_before"] is False and e["signal_after"] == (True, False, 1)   # polled without blocking
    assert e["buckets"] > 2 and e["first"] == (0.0, [])
    assert e["kept_old"] == (0.0, []) and e["same_output"]  # never a mix: the old weights, generating
    assert e["recovered"] == (0.0, [])
