"""Who does what: process groups for training (megatron TP x PP x DP) and rollout (TP groups).

    ranks = setup_ranks(cfg)      # every rank, first thing in a run
    ranks.train.tp_rank, ranks.rollout_dp_rank, ranks.rollout_group, ranks.device ...

Rollout groups are contiguous blocks of `rollout.tensor_model_parallel_size` ranks (on GPUs, one
node's neighbours), so rollout DP = world / rollout TP. The engine on each rank of a group holds
one TP shard; each group generates its share of the prompts.

Disaggregated placement (`rollout.placement=disaggregated`, `rollout.disaggregated_ranks=R`):
the first world - R ranks train, the last R run the engine. Each side starts a torch.distributed
job of its own over a prefix of the launcher's store, so megatron's parallel_state, checkpoints
and the side's collectives (`ranks.group`) cover that side only (`rank`, `world`, `is_main` are
side-local). What reaches across is a Bridge (megarl/parallel/bridge.py) built by its members:
`world_group` (every rank), `handoff_group`, `sync_groups`; `global_rank` numbers the job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
import torch
import torch.distributed as dist

from megarl.checkpoint_engine.distributed import DisaggregatedGroups, megatron_rank
from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig
from megarl.parallel import address_space, state
from megarl.parallel.bridge import Bridge, job_store
from megarl.job.launch_env import rank_env


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
    rollout_group: dist.ProcessGroup | None    # this rank's rollout TP group (None at rollout TP 1)
    role: str = "colocated"                # colocated | trainer | rollout (disaggregated)
    global_rank: int = 0
    group: dist.ProcessGroup | None = None  # this side's ranks (all of them when colocated)
    world_group: Bridge | None = None      # disaggregated: every rank of both sides
    handoff_group: Bridge | None = None    # disaggregated: the trainer ranks + the first rollout rank
    sync_groups: DisaggregatedGroups | None = None  # disaggregated: the weight-sync bridges
    n_trainers: int = 0                    # disaggregated: trainer ranks are [0, n_trainers)
    store: dist.Store | None = None        # disaggregated: the job's key-value store (both sides)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier_all(self) -> None:
        """Wait for every rank of the job (both sides of a disaggregated one)."""
        if self.world_group is not None:
            self.world_group.barrier()
        else:
            dist.barrier(group=self.group)

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
            + (f"; virtual pipeline {t.vpp} chunks per stage" if t.vpp > 1 else "")
            + cfg.model.converters_summary(),
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
    if cfg.rollout.placement == "disaggregated":
        return _setup_disaggregated(cfg, env)
    state.init_distributed(cfg.trainer.collective_timeout_s)
    layout = cfg.actor.megatron
    lay = state.init_model_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                    seed=layout.seed, cp=layout.context_parallel_size,
                                    vpp=layout.virtual_pipeline_model_parallel_size,
                                    ep=layout.expert_model_parallel_size)
    rtp = cfg.rollout.tensor_model_parallel_size
    world, rank = dist.get_world_size(), dist.get_rank()
    return Ranks(rank=rank, world=world, local_rank=env.local_rank, device=state.device(), train=lay,
                 rollout_tp=rtp, rollout_dp=world // rtp, rollout_dp_rank=rank // rtp, rollout_tp_rank=rank % rtp,
                 rollout_group=_rollout_tp_group(world, rank, rtp), group=dist.group.WORLD, global_rank=rank)


def _rollout_tp_group(world: int, rank: int, rtp: int):
    """This rank's block of rtp neighbours in the default group (None at rollout TP 1)."""
    group = None
    for first in range(0, world, rtp):    # every rank must take part in creating every group
        members = list(range(first, first + rtp))
        if rtp > 1:
            address_space.check_room_for_group()
            g = dist.new_group(members, timeout=state.collective_timeout())
            if rank in members:
                group = g
    return group


def _setup_disaggregated(cfg: ExperimentConfig, env) -> Ranks:
    timeout = cfg.trainer.collective_timeout_s
    store, rank, world = job_store(timeout)
    R = cfg.rollout.disaggregated_ranks
    N = world - R
    is_trainer = rank < N
    side, side_rank, side_size = ("trainer", rank, N) if is_trainer else ("rollout", rank - N, R)
    state.init_distributed(timeout, store=dist.PrefixStore(f"megarl/{side}", store), rank=side_rank,
                           world_size=side_size)
    tp, pp = cfg.actor.megatron.tensor_model_parallel_size, cfg.actor.megatron.pipeline_model_parallel_size
    dp = N // (tp * pp)
    rtp = cfg.rollout.tensor_model_parallel_size
    # The bridges: each rank builds those it belongs to, in one order on every rank.
    everyone = Bridge(store, "world", range(world), rank, timeout_s=timeout)
    handoff = Bridge(store, "handoff", range(N + 1), rank, timeout_s=timeout) if rank <= N else None
    sync_groups = DisaggregatedGroups.create(tp, pp, lambda t, d, p: megatron_rank(t, d, p, tp, dp),
                                             list(range(N, world)), store, rank, everyone, device=state.device(),
                                             timeout_s=timeout)
    common = dict(global_rank=rank, world_group=everyone, store=store, handoff_group=handoff, sync_groups=sync_groups,
                  n_trainers=N, rollout_tp=rtp, rollout_dp=R // rtp, local_rank=env.local_rank,
                  device=state.device(), group=dist.group.WORLD)
    if is_trainer:
        lay = state.init_model_parallel(tp, pp, seed=cfg.actor.megatron.seed,
                                        ep=cfg.actor.megatron.expert_model_parallel_size)
        return Ranks(rank=rank, world=N, train=lay, rollout_dp_rank=-1, rollout_tp_rank=-1, role="trainer",
                     rollout_group=None, **common)
    r = rank - N
    return Ranks(rank=r, world=R, train=state.Layout(tp, pp, dp, -1, -1, -1), rollout_dp_rank=r // rtp,
                 rollout_tp_rank=r % rtp, role="rollout", rollout_group=_rollout_tp_group(R, r, rtp), **common)


def destroy(ranks: Ranks | None) -> None:
    """End torch.distributed (this side's job; the bridges end with their last reference)."""
    if dist.is_initialized():
        dist.destroy_process_group()
