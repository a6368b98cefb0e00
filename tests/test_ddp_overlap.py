"""verl's override_ddp_config, megarl's overlap settings: gradient-reduce overlap on real
megatron-core DDP over gloo (4 ranks, one spawn), and the options megarl refuses.

    python -m pytest -q tests/test_ddp_overlap.py

Per layout (DP 4; PP 2 x DP 2, where the schedule starts each stage's reduction as its backward
ends): one update with overlap_grad_reduce on and small buckets, against the same update with it
off. Every parameter after the step agrees to float rounding (gloo's ring all-reduce cuts each
bucket into per-rank chunks by its size, so other buckets sum in another order, and Adam's
normalisation magnifies that where a gradient is near 0: STEP_TOL, a thousandth of the lr-sized
step every tensor takes), and the on run launches its bucket all-reduces asynchronously from the
backward pass, one per bucket.
"""
from __future__ import annotations

import pytest

from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import TEMP, make_batch, policy_loss

LAYOUTS = {"dp4": 1, "pp2_dp2": 2}          # name -> PP
BUCKET = 4096                               # elements: the tiny model's gradients fill several buckets
LR = 1e-3
STEP_TOL = LR * 1e-3


def _actor(path: str, pp: int, ddp: dict):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    mc = MegatronConfig(pipeline_model_parallel_size=pp, override_ddp_config=ddp)
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=1, megatron=mc, entropy_coeff=0.01,
                      optim=OptimConfig(lr=LR))
    state.init_distributed()
    return ActorWorker(ModelConfig(path=path), cfg)


def overlap_runs(rank, world, path):
    import torch.distributed as dist

    from megarl.parallel import state
    launched = []                           # async_op flags of the all-reduces megatron starts
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        launched.append(bool(kwargs.get("async_op", False)))
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counting
    data = make_batch(301, seed=7)
    out = {}
    for name, pp in LAYOUTS.items():
        runs = {}
        for mode, ddp in (("off", {}), ("on", {"overlap_grad_reduce": True, "bucket_size": BUCKET})):
            actor = _actor(path, pp, ddp)
            chunk = actor.engine.chunks[0]          # the DDP-wrapped model the schedule runs
            launched.clear()
            actor.update_policy(data, policy_loss, TEMP)
            runs[mode] = {"params": {n: p.detach().clone() for n, p in actor.engine.named_global_parameters()},
                          "async": sum(launched), "buckets": len(chunk.bucket_groups),
                          "overlap": chunk.ddp_config.overlap_grad_reduce, "stage": actor.engine.layout.pp_rank}
            del actor, chunk
            state.destroy_model_parallel()
        off, on = runs["off"], runs["on"]
        out[name] = {"worst": max((on["params"][n] - off["params"][n]).abs().max().item() for n in off["params"]),
                     "changed": min((off["params"][n] - p).abs().max().item() for n, p in _start(path, pp).items()),
                     **{f"{k}_{m}": runs[m][k] for m in runs for k in ("async", "buckets", "overlap", "stage")}}
    dist.all_reduce = real
    return out


def _start(path, pp):
    """This rank's parameters as loaded (no step): the update must have moved every one."""
    from megarl.parallel import state
    actor = _actor(path, pp, {})
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
            assert got["worst"] < STEP_TOL, (rank, name, got)
            assert got["changed"] > 0.5 * LR, (rank, name)
            assert got["overlap_on"] and not got["overlap_off"]
            # megatron splits the first stage's gradients into bucket_size buckets; a later stage's
            # form one bucket, which its schedule starts as soon as that stage's backward is done.
            assert got["buckets_on"] > 1 if got["stage_on"] == 0 else got["buckets_on"] == 1, got
            assert got["buckets_off"] == 1 and got["async_off"] == 0, got
            assert got["async_on"] == got["buckets_on"], got


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
