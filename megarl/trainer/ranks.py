"""Who does what: process groups for training (megatron TP x PP x DP) and rollout (TP groups).

    ranks = setup_ranks(cfg)      # every rank, first thing in a run
    ranks.train.tp_rank, ranks.rollout_dp_rank, ranks.rollout_group, ranks.device ...

Rollout groups are contiguous blocks of `rollout.tensor_model_parallel_size` ranks (on GPUs, one
node's neighbours), so rollout DP = world / rollout TP. The engine on each rank of a group holds
one TP shard; each group generates its share of the prompts.
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self, cfg: ExperimentConfig) -> list[str]:
        """Lines for the start-up log: what runs where."""
        t, ro = self.train, cfg.rollout
        dev = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if self.device.type == "cuda" else (
            f"CPU ({torch.get_num_threads()} threads per rank)")
        lines = [
            f"ranks: {self.world} ({cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node}), "
            f"backend {dist.get_backend()}, devices: {dev}",
            f"training layout: TP {t.tp} x PP {t.pp} x DP {t.dp} (actor, reference"
            + (", critic" if cfg.critic.enable else "") + ")",
            f"rollout: engine '{ro.name}', {ro.placement}, TP {self.rollout_tp} x DP {self.rollout_dp}, "
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
    if cfg.rollout.placement == "disaggregated":
        raise ConfigError("the trainer runs the engine colocated for now; the disaggregated transport exists "
                          "(megarl/checkpoint_engine) but megatron's layout spans every rank; use placement=colocated",
                          "actor_rollout_ref.rollout.placement")
    if torch.device(state.device()).type == "cpu":
        # Ranks on one host share its cores; oversubscribed OpenMP threads slow every rank down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    state.init_distributed(cfg.trainer.collective_timeout_s)
    layout = cfg.actor.megatron
    lay = state.init_model_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                    seed=layout.seed, ep=layout.expert_model_parallel_size)
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
