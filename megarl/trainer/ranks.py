"""Who does what: process groups for training (megatron TP x PP x DP) and rollout (TP groups).

    ranks = setup_ranks(cfg)      # every rank, first thing in a run
    ranks.train.tp_rank, ranks.rollout_dp_rank, ranks.rollout_group, ranks.device ...

Rollout groups are contiguous blocks of `rollout.tensor_model_parallel_size` ranks (on GPUs, one
node's neighbours), so rollout DP = world / rollout TP. The engine on each rank of a group holds
one TP shard; each group generates its share of the prompts.

Disaggregated placement (`rollout.placement=disaggregated`, `rollout.disaggregated_ranks=R`):
the first world - R ranks train, the last R run the engine. Every group that spans both sides
(the weight-sync groups, the batch hand-off) is created first, over the whole world; then each
side makes its own ranks its default group, so megatron's parallel_state, checkpoints and every
`dist.*` call without a group cover that side only (`rank`, `world`, `is_main` are side-local;
`global_rank` and `world_group` reach across).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import ConfigError, ExperimentConfig
from megarl.parallel import state
from megarl.parallel.launch_env import rank_env


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    train: state.Layout
    rollout_tp: int
    rollout_dp: int
    rollout_dp_rank: int
    rollout_tp_rank: int
    rollout_group: Any                     # this rank's rollout TP group (None at rollout TP 1)
    role: str = "colocated"                # colocated | trainer | rollout (disaggregated)
    global_rank: int = 0
    world_group: Any = None                # disaggregated: every rank of both sides
    handoff_group: Any = None              # disaggregated: the trainer ranks + the first rollout rank
    sync_groups: Any = None                # disaggregated: checkpoint_engine DisaggregatedGroups
    n_trainers: int = 0                    # disaggregated: trainer ranks are [0, n_trainers)
    store: Any = None                      # disaggregated: the job's key-value store (both sides)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self, cfg: ExperimentConfig) -> list[str]:
        """Lines for the start-up log: what runs where."""
        t, ro = self.train, cfg.rollout
        dev = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if self.device.type == "cuda" else (
            f"CPU ({torch.get_num_threads()} threads per rank)")
        count = (f"{self.world}" if self.role == "colocated" else
                 f"{self.n_trainers} training + {self.rollout_tp * self.rollout_dp} rollout")
        lines = [
            f"ranks: {count} ({cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node}), "
            f"backend {dist.get_backend()}, devices: {dev}",
            f"training layout: TP {t.tp}" + (f" x CP {t.cp}" if t.cp > 1 else "") + f" x PP {t.pp} x DP {t.dp} "
            f"(actor, reference" + (", critic" if cfg.critic.enable else "") + ")"
            + ("; sequence parallel" if cfg.actor.megatron.sequence_parallel_on else "")
            + (f"; virtual pipeline {t.vpp} chunks per stage" if t.vpp > 1 else ""),
            f"rollout: engine '{ro.name}', {ro.placement}"
            + (f" (ranks {self.n_trainers}-{self.n_trainers + self.rollout_tp * self.rollout_dp - 1})"
               if self.role != "colocated" else "") + f", TP {self.rollout_tp} x DP {self.rollout_dp}, "
            f"dtype {ro.dtype}, n={ro.n}, temperature {ro.temperature}",
            f"algorithm: {cfg.algorithm.adv_estimator}, policy loss {cfg.actor.policy_loss.loss_mode}, "
            f"kl_in_reward={cfg.algorithm.use_kl_in_reward}, kl_loss={cfg.actor.use_kl_loss}",
        ]
        return lines


def _pick_device(cfg: ExperimentConfig) -> None:
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("asks for CUDA but no GPU is visible; set trainer.device=cpu or auto", "trainer.device")
    if want == "cpu" and torch.cuda.is_available():
        # megarl picks CUDA whenever it is visible; hide it for an explicit CPU run.
        raise ConfigError("is cpu but GPUs are visible; export CUDA_VISIBLE_DEVICES= to run on CPU, "
                          "or set trainer.device=auto", "trainer.device")


def setup_ranks(cfg: ExperimentConfig) -> Ranks:
    env = rank_env(cfg)
    _pick_device(cfg)
    if torch.device(state.device()).type == "cpu":
        # Ranks on one host share its cores; oversubscribed OpenMP threads slow every rank down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    state.init_distributed(cfg.trainer.collective_timeout_s)
    if cfg.rollout.placement == "disaggregated":
        return _setup_disaggregated(cfg, env)
    layout = cfg.actor.megatron
    lay = state.init_model_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                    seed=layout.seed, cp=layout.context_parallel_size,
                                    vpp=layout.virtual_pipeline_model_parallel_size,
                                    ep=layout.expert_model_parallel_size)
    rtp = cfg.rollout.tensor_model_parallel_size
    world, rank = dist.get_world_size(), dist.get_rank()
    group = None
    for first in range(0, world, rtp):    # every rank must take part in creating every group
        members = list(range(first, first + rtp))
        g = dist.new_group(members) if rtp > 1 else None
        if rank in members:
            group = g
    return Ranks(rank=rank, world=world, local_rank=env.local_rank, device=state.device(), train=lay,
                 rollout_tp=rtp, rollout_dp=world // rtp, rollout_dp_rank=rank // rtp, rollout_tp_rank=rank % rtp,
                 rollout_group=group)


def _setup_disaggregated(cfg: ExperimentConfig, env) -> Ranks:
    from torch.distributed.distributed_c10d import _get_default_group, _get_default_store, _update_default_pg

    from megarl.checkpoint_engine.distributed import DisaggregatedGroups, megatron_rank

    world, rank = dist.get_world_size(), dist.get_rank()
    R = cfg.rollout.disaggregated_ranks
    N = world - R
    tp, pp = cfg.actor.megatron.tensor_model_parallel_size, cfg.actor.megatron.pipeline_model_parallel_size
    dp = N // (tp * pp)
    rtp = cfg.rollout.tensor_model_parallel_size
    # Collective on the whole world, in one order on every rank: every group either side needs.
    world_group = _get_default_group()    # kept: destroy() makes it the default again
    store = _get_default_store()
    trainers, rollouts = dist.new_group(list(range(N))), dist.new_group(list(range(N, world)))
    handoff = dist.new_group(list(range(N + 1)))
    sync_groups = DisaggregatedGroups.create(tp, pp, lambda t, d, p: megatron_rank(t, d, p, tp, dp),
                                             list(range(N, world)), everyone=world_group)
    group = None
    for first in range(N, world, rtp):
        members = list(range(first, first + rtp))
        g = dist.new_group(members) if rtp > 1 else None
        if rank in members:
            group = g
    is_trainer = rank < N
    # From here on, each side's default group is its own ranks (see the module docstring).
    _update_default_pg(trainers if is_trainer else rollouts)
    common = dict(global_rank=rank, world_group=world_group, store=store, handoff_group=handoff, sync_groups=sync_groups,
                  n_trainers=N, rollout_tp=rtp, rollout_dp=R // rtp, rollout_group=group, local_rank=env.local_rank,
                  device=state.device())
    if is_trainer:
        lay = state.init_model_parallel(tp, pp, seed=cfg.actor.megatron.seed,
                                        ep=cfg.actor.megatron.expert_model_parallel_size)
        return Ranks(rank=rank, world=N, train=lay, rollout_dp_rank=-1, rollout_tp_rank=-1, role="trainer", **common)
    r = rank - N
    return Ranks(rank=r, world=R, train=state.Layout(tp, pp, dp, -1, -1, -1), rollout_dp_rank=r // rtp,
                 rollout_tp_rank=r % rtp, role="rollout", **common)


def destroy(ranks: Ranks | None) -> None:
    """End torch.distributed; a disaggregated side first gives the whole world back its default
    group, so every group is torn down together."""
    if not dist.is_initialized():
        return
    if ranks is not None and ranks.world_group is not None:
        from torch.distributed.distributed_c10d import _update_default_pg
        _update_default_pg(ranks.world_group)
    dist.destroy_process_group()
