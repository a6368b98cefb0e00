"""What a launcher and a rank need to agree on: the layout, the run directory, the timeouts.

`shell_assignments(cfg)` and `check_launch(...)` serve the launch scripts' command
(`python -m megarl.launcher.vars`, megarl/launcher/vars.py). Inside a rank, `rank_env(cfg)` reads the
torchrun/srun variables and checks them against the config.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig

# Slack given to a launcher on top of the collective timeout: a rank that outlives its peers
# by more than this is stuck, not slow (every rank ends at the same final collective).
SHUTDOWN_SLACK_S = 60


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def rank_env(cfg: ExperimentConfig, environ: dict | None = None) -> RankEnv:
    """The standard variables torchrun sets (and launch/slurm/rank_env.sh sets from SLURM_*),
    checked against trainer.nnodes x trainer.n_gpus_per_node."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: start ranks with torchrun, launch/torchrun.sh or "
                          "launch/slurm/*.sbatch (or bare megarl-train on one node)", "trainer.n_gpus_per_node")
    got = RankEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                  local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                  master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))
    if got.world_size != cfg.trainer.world_size:
        raise ConfigError(f"the launcher started {got.world_size} processes but trainer.nnodes x "
                          f"trainer.n_gpus_per_node = {cfg.trainer.nnodes} x {cfg.trainer.n_gpus_per_node} = "
                          f"{cfg.trainer.world_size}; make them agree", "trainer.n_gpus_per_node")
    return got


def shell_assignments(cfg: ExperimentConfig) -> dict[str, str]:
    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    timeout = math.ceil(cfg.trainer.collective_timeout_s)
    return {
        "MEGARL_RUN_DIR": run_dir,
        "MEGARL_LOG_DIR": os.path.join(run_dir, "logs"),
        "MEGARL_NNODES": str(cfg.trainer.nnodes),
        "MEGARL_NPROC_PER_NODE": str(cfg.trainer.n_gpus_per_node),
        "MEGARL_WORLD_SIZE": str(cfg.trainer.world_size),
        "MEGARL_COLLECTIVE_TIMEOUT_S": str(timeout),
        "MEGARL_SHUTDOWN_WAIT_S": str(timeout + SHUTDOWN_SLACK_S),
        "MEGARL_EXPERIMENT": cfg.trainer.experiment_name,
    }


def check_launch(cfg: ExperimentConfig, nnodes: int | None, nproc_per_node: int | None, by: str) -> None:
    """Refuse a config whose layout differs from what the launcher is about to start."""
    tr = cfg.trainer
    if nnodes is not None and tr.nnodes != nnodes:
        raise ConfigError(f"is {tr.nnodes}, but {by} runs on {nnodes} node(s); drop the override or change "
                          "the allocation", "trainer.nnodes")
    if nproc_per_node is not None and tr.n_gpus_per_node != nproc_per_node:
        raise ConfigError(f"is {tr.n_gpus_per_node}, but {by} starts {nproc_per_node} process(es) per node; "
                          "drop the override or change the allocation", "trainer.n_gpus_per_node")
