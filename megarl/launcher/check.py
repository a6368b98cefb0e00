"""A small real distributed job that goes through the launch path the way megarl.train does.

    MEGARL_ENTRY=megarl.launcher.check launch/torchrun.sh configs/quickstart.yaml trainer.total_training_steps=5
    MEGARL_ENTRY=megarl.launcher.check sbatch launch/slurm/quickstart.sbatch trainer.save_freq=2

It takes megarl-train's arguments and config, starts the process group from env:// with
trainer.collective_timeout_s, and per step all-reduces a known value, appends a record to
<trainer.default_local_dir>/metrics.jsonl and saves a tiny checkpoint every trainer.save_freq
steps; trainer.resume_mode=auto continues after the latest complete one. The launch tests use it
until the trainer exists, and it stays useful for checking a cluster's launch setup.

Knobs for tests (environment, so the config stays the user's):
    MEGARL_CHECK_STEP_S=0.5            sleep per step, so a job can be cancelled mid-run
    MEGARL_CHECK_FAIL=RANK:STEP:MODE   MODE = raise | exit | kill (SIGKILL itself) | hang
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig
from megarl.parallel.shared_storage import check_shared_dir
from megarl.job.launch_env import rank_env
from megarl.launcher.cli import load_checked, parse_args
from megarl.parallel.own_lines import own_line
from megarl.trainer.metrics.logger import MetricsLogger

LATEST = "latest_checkpointed_iteration.txt"  # verl's name for the pointer to the newest step


def latest_step(run_dir: str) -> int:
    """The newest checkpoint that every rank finished writing (0: none)."""
    path = os.path.join(run_dir, LATEST)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(f.read().strip())


def save(run_dir: str, step: int, rank: int, state: dict) -> None:
    step_dir = os.path.join(run_dir, f"global_step_{step}")
    os.makedirs(step_dir, exist_ok=True)
    with open(os.path.join(step_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(state, f)
    # The pointer moves only after every rank wrote its part, and by rename, so a job killed
    # half-way through a save resumes from the previous complete checkpoint.
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(run_dir, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(run_dir, LATEST))
    dist.barrier()


def load(run_dir: str, step: int, rank: int) -> dict:
    with open(os.path.join(run_dir, f"global_step_{step}", f"rank_{rank}.json")) as f:
        return json.load(f)


def inject_failure(rank: int, step: int) -> None:
    spec = os.environ.get("MEGARL_CHECK_FAIL")
    if not spec:
        return
    want_rank, want_step, mode = spec.split(":")
    if (int(want_rank), int(want_step)) != (rank, step):
        return
    print(f"launch_check: rank {rank} fails at step {step} ({mode})", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":  # alive but silent: the peers must give up after the collective timeout
        time.sleep(10**6)
    raise ValueError(f"MEGARL_CHECK_FAIL mode {mode!r}: use raise, exit, kill or hang")


def run(cfg: ExperimentConfig) -> int:
    env = rank_env(cfg)
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if use_cuda:  # one visible GPU per task (srun --gpus-per-task) or all of the node's
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://",
                            timeout=timedelta(seconds=cfg.trainer.collective_timeout_s))
    tr = cfg.trainer
    run_dir = tr.default_local_dir
    try:
        check_shared_dir(run_dir)
    except ConfigError as err:
        own_line(f"megarl: config error: {err}")
        dist.destroy_process_group()
        return 2
    total = tr.total_training_steps or 10
    start = latest_step(run_dir) if tr.resume_mode == "auto" else 0
    state = load(run_dir, start, env.rank) if start else {"step": 0, "acc": 0.0}
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    print(f"launch_check: rank {env.rank}/{env.world_size} local {env.local_rank} on {socket.gethostname()} "
          f"({torch.get_num_threads()} threads, gloo on {os.environ.get('GLOO_SOCKET_IFNAME', 'the hostname')}) "
          f"resumes after step {start}", flush=True)
    logger = MetricsLogger(tr.log_dir or run_dir, ["console"], tr.project_name, tr.experiment_name,
                           enabled=env.rank == 0, total_steps=total)
    step_s = float(os.environ.get("MEGARL_CHECK_STEP_S", "0"))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    for step in range(start + 1, total + 1):
        begin = time.time()
        inject_failure(env.rank, step)
        value = torch.tensor([float((env.rank + 1) * step)], device=device)
        dist.all_reduce(value)
        expected = env.world_size * (env.world_size + 1) / 2 * step
        if value.item() != expected:
            raise RuntimeError(f"all_reduce gave {value.item()}, expected {expected}")
        state = {"step": step, "acc": state["acc"] + value.item()}
        time.sleep(step_s)
        logger.log(step, {"launch/allreduce_sum": value.item(), "launch/acc": state["acc"],
                          "launch/world_size": env.world_size, "launch/resumed_from": start,
                          "launch/restart_count": restarts, "launch/job_id": os.environ.get("SLURM_JOB_ID", ""),
                          "timing_s/step": time.time() - begin})
        if (tr.save_freq > 0 and step % tr.save_freq == 0) or step == total:
            save(run_dir, step, env.rank, state)
    dist.barrier()
    dist.destroy_process_group()
    logger.info(f"launch_check: done, {total} steps, acc {state['acc']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # record() hands this rank's traceback to torchrun, whose failure summary then names the
    # rank and the exception; under srun the traceback is in the task's labelled output.
    @record
    def checked() -> int:
        args = parse_args(argv)
        try:
            cfg = load_checked(args.config, args.overrides, check_all=False)
            rank_env(cfg)
        except ConfigError as err:
            own_line(f"megarl: config error: {err}")
            return 2
        return run(cfg)

    return checked() or 0             # record's type allows None; checked returns an int


if __name__ == "__main__":
    sys.exit(main())
