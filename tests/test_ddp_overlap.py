"""verl's override_ddp_config, megarl's overlap settings: gradient-reduce overlap on real
megatron-core DDP over gloo (4 ranks, one spawn), and the options megarl refuses.

    python -m pytest -q tests/test_ddp_overlap.py

Per layout at DP 2 (TP 2 x DP 2; PP 2 x DP 2, where the schedule starts a stage's reduction as
its backward ends): two updates with overlap_grad_reduce on and small buckets, against the same
updates with it off. Every parameter after them is bit-identical (a sum of two ranks does not
depend on the bucket layout), and in the second update (megatron's first one reduces after the
schedule, to learn how many gradients each bucket waits for) every bucket's all-reduce starts
asynchronously from the backward pass, once (the schedule's no_sync holds all micro-batches but the
last, as megatron's training loop wires it).
"""
from __future__ import annotations

import pytest

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import TEMP, make_batch, policy_loss

LAYOUTS = {"tp2_dp2": (2, 1), "pp2_dp2": (1, 2)}   # name -> (TP, PP)
BUCKET = 4096                               # elements: the tiny model's gradients fill several buckets
LR = 1e-3


def _actor(path: str, tp: int, pp: int, ddp: dict):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    mc = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, override_ddp_config=ddp)
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=1, megatron=mc, entropy_coeff=0.01,
                      optim=OptimConfig(lr=LR))
    state.init_distributed()
    return ActorWorker(ModelConfig(path=path), cfg)


def overlap_runs(rank, world, path):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel

    from megarl.parallel import state
    # Which all-reduces megatron starts, and whether from the backward pass (a gradient hook) or
    # from finish_grad_sync after the schedule: megatron's first step reduces there to learn how
    # many gradients each bucket waits for, later steps from the hooks.
    seen = {"finishing": False, "launched": []}
    real_reduce, real_finish = dist.all_reduce, DistributedDataParallel.finish_grad_sync

    def counting(tensor, *args, **kwargs):
        seen["launched"].append((bool(kwargs.get("async_op", False)), seen["finishing"]))
        return real_reduce(tensor, *args, **kwargs)

    def finish(self, *args, **kwargs):
        seen["finishing"] = True
        try:
            return real_finish(self, *args, **kwargs)
        finally:
            seen["finishing"] = False
    dist.all_reduce, DistributedDataParallel.finish_grad_sync = counting, finish
    data = make_batch(301, seed=7)
    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        runs = {}
        for mode, ddp in (("off", {}), ("on", {"overlap_grad_reduce": True, "bucket_size": BUCKET})):
            actor = _actor(path, tp, pp, ddp)
            chunk = actor.engine.chunks[0]          # the DDP-wrapped model the schedule runs
            actor.update_policy(data, policy_loss, TEMP)
            seen["launched"].clear()
            actor.update_policy(data, policy_loss, TEMP)
            groups = chunk.bucket_groups
            runs[mode] = {"params": {n: p.detach().clone() for n, p in actor.engine.named_global_parameters()},
                          "from_backward": sum(a and not fin for a, fin in seen["launched"]),
                          "async": sum(a for a, _ in seen["launched"]), "buckets": len(groups),
                          # no_sync holds every micro-batch but the last: each gradient is ready once
                          "ready_counts": sorted({c for g in groups
                                                  for c in g.golden_per_param_grad_ready_counts.values()}),
                          "overlap": chunk.ddp_config.overlap_grad_reduce, "stage": actor.engine.layout.pp_rank}
            del actor, chunk, groups
            state.destroy_model_parallel()
        off, on = runs["off"], runs["on"]
        out[name] = {"worst": max((on["params"][n] - off["params"][n]).abs().max().item() for n in off["params"]),
                     "changed": min((off["params"][n] - p).abs().max().item() for n, p in _start(path, tp, pp).items()),
                     **{f"{k}_{m}": runs[m][k] for m in runs
                        for k in ("async", "from_backward", "buckets", "ready_counts", "overlap", "stage")}}
    dist.all_reduce, DistributedDataParallel.finish_grad_sync = real_reduce, real_finish
    return out


def _start(path, tp, pp):
    """This rank's parameters as loaded (no step): the update must have moved every one."""
    from megarl.parallel import state
    actor = _actor(path, tp, pp, {})
    got = {n: p.detach().clone() for n, p in actor.engine.named_global_parameters()}
    del actor
    state.destroy_model_parallel()
    return got


@pytest.mark.timeout(900)
def test_overlap_grad_reduce_on_gloo_gives_the_same_step(tmp_path):
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=3, vocab_size=301)
    results = run_ranks(4, overlap_runs, (path,))
    for rank, r in enumerate(results):
        for name, got in r.items():
            print(f"rank {rank} {name}: {got}")
            assert got["worst"] == 0.0, (rank, name, got)
            assert got["changed"] > 0.5 * LR, (rank, name)
            assert got["overlap_on"] and not got["overlap_off"]
            # megatron splits the first stage's gradients into bucket_size buckets; a later stage's
            # form one bucket, which its schedule starts as soon as that stage's backward is done.
            assert got["buckets_on"] > 1 if got["stage_on"] == 0 else got["buckets_on"] == 1, got
            assert got["buckets_off"] == 1 and got["async_off"] == 0, got
            assert got["from_backward_on"] == got["async_on"] == got["buckets_on"], got
            # stage 0 starts a bucket when its gradients are ready (hooks, counted once per step
            # under no_sync); a later stage's one bucket is started by the schedule's grad_sync_func
            assert got["ready_counts_on"] == ([1] if got["stage_on"] == 0 else []), got


@pytest.mark.parametrize("ddp, says", [
    ("{overlap_param_gather: true}", "override_ddp_config.overlap_param_gather: is not supported"),
    ("{align_param_gather: true}", "override_ddp_config.align_param_gather: is not supported"),
    ("{grad_reduce_in_fp32: false}", "override_ddp_config.grad_reduce_in_fp32: is not one of the DDP options "
                                     "megarl passes to megatron: bucket_size, overlap_grad_reduce"),
    ("{overlap_grad_reduce: yes_please}", "override_ddp_config.overlap_grad_reduce: must be true or false"),
    ("{bucket_size: 0}", "override_ddp_config.bucket_size: must be > 0 elements or null"),
])
def test_refused_ddp_options_name_the_key(ddp, says):
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.megatron." + says):
        load_config(None, [f"actor_rollout_ref.actor.megatron.override_ddp_config={ddp}"])


def test_verls_empty_and_false_values_are_accepted():
    from megarl.experiment import load_config
    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.override_ddp_config={}",
                             "critic.megatron.override_ddp_config={overlap_param_gather: false}",
                             "actor_rollout_ref.ref.megatron.override_ddp_config={}"])
    assert cfg.actor.megatron.override_ddp_config == {}
    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.override_ddp_config="
                             "{overlap_grad_reduce: true, bucket_size: 40000000}"])
    assert cfg.actor.megatron.override_ddp_config == {"overlap_grad_reduce": True, "bucket_size": 40_000_000}
