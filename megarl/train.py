"""megarl-train: run an RL experiment from a YAML config.

    megarl-train --config configs/quickstart.yaml [section.key=value ...] [--print-config]
    python -m megarl.train ...                      (the same)
    torchrun --nproc_per_node 2 -m megarl.train ...  (what launch/ scripts run)

Started without torchrun/srun and with trainer.nnodes x trainer.n_gpus_per_node > 1 on one node,
it starts that many local processes itself through torch.distributed.run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megarl.config import ConfigError, ExperimentConfig, load_config
from megarl.config.experiment import read_hf_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c", help="experiment YAML (may name a `base:`)")
    parser.add_argument("--print-config", action="store_true",
                        help="validate, print the resolved config and exit without starting anything")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.rollout.n=5")
    return parser.parse_args(argv)


def load_checked(config: str | None, overrides: list[str]) -> ExperimentConfig:
    cfg = load_config(config, overrides)
    if cfg.model.path:
        hf = read_hf_config(cfg.model.path)
        if hf is not None:
            cfg.check_model(hf)
    return cfg


def _launched_by_a_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ and "MEGARL_SLURM_TASK_PER_RANK" in os.environ


def relaunch_locally(cfg: ExperimentConfig, argv: list[str]) -> int:
    nproc = cfg.trainer.n_gpus_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megarl.train", *argv]
    print(f"megarl: starting {nproc} local processes: {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd)


def single_process_env() -> None:
    """The variables torchrun would set, for a one-process run started bare."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        cfg = load_checked(args.config, args.overrides)
    except ConfigError as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if not _launched_by_a_launcher():
        if cfg.trainer.nnodes > 1:
            print("megarl: config error: trainer.nnodes > 1 needs a launcher; use launch/slurm/*.sbatch "
                  "or torchrun on every node", file=sys.stderr)
            return 2
        if cfg.trainer.world_size > 1:
            return relaunch_locally(cfg, argv)
        single_process_env()
    from torch.distributed.elastic.multiprocessing.errors import record
    from megarl.trainer.run import run  # imported late: torch/megatron start-up is slow
    # record() hands a failing rank's traceback to torchrun, whose summary then names rank and cause.
    return record(run)(cfg, config_path=args.config, overrides=args.overrides)


if __name__ == "__main__":
    sys.exit(main())
