"""megarl-train: run an RL experiment from a YAML config.

    megarl-train --config configs/quickstart.yaml [section.key=value ...] [--print-config | --check] [--verbose]
    python -m megarl.train ...                      (the same)
    torchrun --nproc_per_node 2 -m megarl.train ...  (what launch/ scripts run)

Started without torchrun/srun, it checks everything it can (megarl/launcher/preflight.py: a bad input is one
line and exit code 2), locks the run directory, then starts trainer.n_gpus_per_node local processes
(through torchrun, megarl/parallel/torchrun.py, when more than one) and copies their output to <run dir>/logs/.
torchrun's agent starts as soon as the config loads, loading torch during the checks, and starts the
ranks only once they pass (megarl/launcher/held.py).
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig
from megarl.config.own_defaults import own_defaults_note
from megarl.config.verl_keys import refuse_hydra_flags
from megarl.launcher.cli import PREFLIGHT_DONE_ENV, load_checked, parse_args
from megarl.launcher.held import TORCHRUN, HeldTorchrun
from megarl.launcher.logs import VERBOSE_ENV, quiet_known_noise
from megarl.launcher.output import RankOutput
from megarl.launcher.preflight_run import tighten_run_dir, tokenizer_available
from megarl.parallel.own_lines import RECORDS_ENV, own_line
from megarl.parallel.lifecycle import LOCK_HELD_ENV, RunDirLock, die_with_parent, exit_now, tell_launcher
from megarl.parallel.supervise import LogCopy, run_tree
from megarl.storage.durable import make_private_dir
from megarl.launcher.preflight import bootstrap_and_check


def _launched_by_a_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ and "MEGARL_SLURM_TASK_PER_RANK" in os.environ


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def ranks_env(nproc: int) -> dict[str, str]:
    """The environment this node's ranks start with, less what spawn_ranks adds (lock, records)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[PREFLIGHT_DONE_ENV] = "1"      # checked here, just now: the ranks check only their node
    if nproc > 1:
        # torchrun's banner about OMP_NUM_THREADS appears only when it is unset; launch/torchrun.sh's rule.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def spawn_ranks(cfg: ExperimentConfig, argv: list[str], agent: HeldTorchrun | None = None) -> int:
    """Start this node's ranks (torchrun for several, one child for one), holding the run
    directory's lock for them, and copy their output to <run dir>/logs/megarl-*.log. `agent`:
    torchrun already loading torch (held.py), told here to start the ranks."""
    nproc = cfg.trainer.n_gpus_per_node
    env = ranks_env(nproc)
    if nproc > 1:
        # The static rendezvous: its store holds JSON and bytes. --standalone's c10d rendezvous keeps
        # pickled state in a store any local user can write, and unpickles it (docs/security.md).
        cmd = [*TORCHRUN, "--rdzv-backend=static", "--nnodes=1", "--node-rank=0",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--nproc_per_node={nproc}",
               "-m", "megarl.train", *argv]
    else:
        cmd = [sys.executable, "-m", "megarl.train", *argv]
        env.update(single_process_env())
    run_dir = cfg.trainer.default_local_dir
    if note := tighten_run_dir(run_dir):
        print(note, flush=True)
    lock = RunDirLock(run_dir).acquire()
    env[LOCK_HELD_ENV] = lock.path
    log_dir = os.path.join(run_dir, "logs")
    make_private_dir(log_dir)
    log_path = os.path.join(log_dir, f"megarl-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    print(f"megarl: starting {nproc} process{'es' if nproc > 1 else ''}; log {log_path}", flush=True)
    log = LogCopy(log_path)
    # The ranks record their status lines here (own_line): only those end the console's copy.
    records_fd, records = tempfile.mkstemp(dir=log_dir, prefix=".own-lines-")
    os.close(records_fd)
    env[RECORDS_ENV] = records
    echo = RankOutput(sys.stdout.buffer, log_path, records)   # a rank's config error ends the console copy

    def copy(chunk: bytes) -> None:
        try:
            echo.write(chunk)
        except OSError:
            pass                     # a closed console must not stop the run; the log keeps it
        log.write(chunk)
    try:
        # Every process of the run stays below this one and ends with it (megarl/parallel/supervise.py).
        started = agent.go(cmd[len(TORCHRUN):], env) if agent is not None and nproc > 1 else None
        return echo.exit_code(run_tree(cmd, env, copy, started))
    finally:
        log.close()
        os.unlink(records)
        lock.release()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> dict[str, str]:
    """The variables torchrun would set, for a one-process run."""
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def config_error(err: ConfigError) -> int:
    """One line on stderr (from rank 0 only, when ranks run it), exit code 2."""
    if _rank() == 0:
        own_line(f"megarl: config error: {err}")
    if _launched_by_a_launcher() and "TORCHELASTIC_ERROR_FILE" in os.environ:
        tell_launcher(err)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # What a run writes (config, logs, metrics, checkpoints, dumps, TensorBoard's events) is its
    # user's alone whatever the shell's umask (000 on some clusters); the ranks inherit it.
    os.umask(0o077)
    try:
        refuse_hydra_flags(argv)
    except ConfigError as err:
        return config_error(err)
    args = parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"          # ranks inherit it
    launched = _launched_by_a_launcher()
    if launched:
        die_with_parent()                      # a rank never outlives the launcher that started it
    agent = HeldTorchrun.none()

    def hold_torchrun(cfg: ExperimentConfig) -> None:
        # torchrun's agent loads torch while the checks below run; it starts ranks only at spawn_ranks.
        nonlocal agent
        tr = cfg.trainer
        if not launched and not args.check and not args.print_config and tr.nnodes == 1 and tr.n_gpus_per_node > 1:
            agent = HeldTorchrun.start(ranks_env(tr.n_gpus_per_node))
    try:
        # --print-config shows the typed tree (defaults included) without looking at files.
        not_checked: list[str] | None = [] if args.check and not launched else None
        cfg = load_checked(args.config, args.overrides, check_all=not args.print_config, not_checked=not_checked,
                           loaded=hold_torchrun)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        # Once per run: the launching process, or rank 0 of a job torchrun/srun started directly.
        note = own_defaults_note(cfg, ExperimentConfig())
        if note and (not launched or (_rank() == 0 and LOCK_HELD_ENV not in os.environ)):
            print(note, flush=True)
        if args.check:
            from megarl.launcher.versions import versions_report   # package metadata only, no import
            print("\n".join(versions_report()), flush=True)
            later = ("" if tokenizer_available(cfg) else " (the data is tokenized and scored once the bootstrap has "
                     "built the model, before the first run's ranks start)")
            from megarl.launcher.check_report import report  # lazy: the plan's model shapes import torch
            report(cfg, not_checked or [])        # the memory plan; what only the nodes can check
            print(f"megarl: config and inputs check out{later}; nothing was started")
            return 0
        if not launched:
            if cfg.trainer.nnodes > 1:
                raise ConfigError("trainer.nnodes > 1 needs a launcher; use launch/slurm/*.sbatch or torchrun on "
                                  "every node")
            quiet_known_noise(cpu=cfg.trainer.device == "cpu")    # a bootstrap may import megatron here
            bootstrap_and_check(cfg)
            return spawn_ranks(cfg, argv, agent)
        lock = None
        if _rank() == 0 and LOCK_HELD_ENV not in os.environ:  # started by torchrun/srun directly
            if note := tighten_run_dir(cfg.trainer.default_local_dir):
                print(note, flush=True)
            lock = RunDirLock(cfg.trainer.default_local_dir).acquire()
    except ConfigError as err:
        return config_error(err)
    finally:
        agent.cancel()                         # a refused run's agent; once started by go(), not touched
    # Megatron's TP/SP overlap orders its kernels by relying on one hardware queue; it must be
    # set before CUDA starts. The user's own value wins.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import torch  # lazy: torch loads only once the config is accepted
    quiet_known_noise(cpu=cfg.trainer.device == "cpu" or not torch.cuda.is_available())
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy, as torch above
    from megarl.models.megatron_import import import_megatron  # lazy, as torch above
    import_megatron()                    # before anything imports megatron: its kernels compile on first use
    from megarl.job.run import run  # imported late: torch/megatron start-up is slow
    # record() hands a failing rank's traceback to torchrun, whose summary then names rank and cause.
    try:
        return record(run)(cfg, config_path=args.config, overrides=args.overrides) or 0   # record's type allows None
    finally:
        if lock is not None:
            lock.release()


def program() -> None:
    """`megarl-train` and `python -m megarl.train`: main(), then a quick exit (lifecycle.exit_now)."""
    exit_now(main())


if __name__ == "__main__":
    program()
