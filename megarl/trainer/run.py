"""One training run on this rank: set up ranks, build the parts, fit, clean up.

Called by `megarl-train` (megarl/train.py) on every rank started by torchrun / srun.
"""
from __future__ import annotations

import json
import os
import sys
import time

from megarl.config import ConfigError
from megarl.reward.manager import RewardFailure
from megarl.trainer.checkpointing import CheckpointSaveError
from megarl.trainer.disaggregated import build_rollout_parts, build_trainer_parts
from megarl.trainer.fit import BadStepLimit, RLTrainer
from megarl.trainer.fit_async import AsyncRLTrainer, RolloutWorker
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.parts import build_parts, write_run_dir
from megarl.trainer.plot import plot_reward_curve
from megarl.parallel.shared_storage import check_shared_dir
from megarl.trainer.ranks import destroy, setup_ranks


def tell_launcher(err: BaseException) -> None:
    """Write this rank's cause into torchrun's error file. A rank that returns an exit code leaves
    none, and torchrun's summary would then blame a peer's later "connection closed" instead."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")   # set by torchrun; absent otherwise
    if not path:
        return
    # torch's ErrorHandler.record_exception format, with the one-line message where it puts the
    # traceback: these errors are the user's to fix, and torchrun's summary prints that field.
    line = f"{type(err).__name__}: {err}"
    with open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                               "timestamp": str(int(time.time()))}}}, f)


def run(cfg, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    tr = cfg.trainer
    rank, ranks = 0, None
    try:
        ranks = setup_ranks(cfg)
        rank = ranks.global_rank if ranks.role != "colocated" else ranks.rank
        check_shared_dir(tr.default_local_dir)    # before anything is saved where a node cannot see it
        if ranks.role == "rollout":
            return _run_rollout(cfg, ranks)
        log = MetricsLogger(tr.log_dir or tr.default_local_dir, tr.logger, tr.project_name, tr.experiment_name,
                            config=cfg.to_dict(), enabled=ranks.is_main)
        if ranks.is_main:
            for line in ranks.describe(cfg):
                log.info(f"megarl: {line}")
        if ranks.role == "trainer":
            parts = build_trainer_parts(cfg, ranks, log)
        else:
            parts = build_parts(cfg, ranks, log)
        log.total_steps = parts.total_steps
        log.info(f"megarl: {parts.total_steps} steps of {cfg.data.train_batch_size} prompts x {cfg.rollout.n}; "
                 f"run dir {tr.default_local_dir}")
        trainer = (AsyncRLTrainer if ranks.role == "trainer" else RLTrainer)(cfg, ranks, parts, log)
        if ranks.is_main:   # after a successful resume: a refused one leaves the run's record as it was
            trainer.on_started = lambda: write_run_dir(cfg, tr.default_local_dir, config_path, list(overrides))
        try:
            trainer.fit()
        finally:
            if parts.reward is not None:
                parts.reward.close()
            if ranks.is_main and tr.plot_reward_curve:
                path = plot_reward_curve(tr.log_dir or tr.default_local_dir)
                if path:
                    log.info(f"megarl: reward curve: {path}")
            log.close()
    except ConfigError as err:
        print(f"megarl: config error: {err}" if rank == 0 else f"megarl: rank {rank}: config error: {err}",
              file=sys.stderr, flush=True)
        tell_launcher(err)
        return 2
    except (RewardFailure, CheckpointSaveError) as err:  # a reward's deadline or failures, a full disk: one line
        if rank == 0 or isinstance(err, CheckpointSaveError):
            print(f"megarl: stopped: {err}", file=sys.stderr, flush=True)
        tell_launcher(err)
        return 3
    except BadStepLimit as err:
        print(f"megarl: stopped: {err}", file=sys.stderr, flush=True)
        return 3
    except RuntimeError as err:
        if not _collective_timed_out(err):
            raise
        # One line instead of torch's trace: the cause is a peer (stopped, hung or far slower), not this rank.
        line = (f"rank {rank}: a collective waited past trainer.collective_timeout_s={tr.collective_timeout_s:g}s "
                "for another rank; find the rank that stopped (or raise trainer.collective_timeout_s)")
        print(f"megarl: stopped: {line}", file=sys.stderr, flush=True)
        tell_launcher(RuntimeError(line))
        return 4
    finally:
        destroy(ranks)
    return 0


def _collective_timed_out(err: BaseException) -> bool:
    """gloo's words for a collective that gave up waiting (torch 2.13: "Timed out waiting 4000ms for
    recv operation to complete"); NCCL's watchdog ends the process itself."""
    return "Timed out waiting" in str(err) or "timed out" in str(err).lower() and "collective" in str(err).lower()


def _run_rollout(cfg, ranks) -> int:
    """The rollout ranks of a disaggregated run (their errors reach the trainer side as a failed
    collective; torchrun / srun then stop the job, naming the rank)."""

    parts = build_rollout_parts(cfg, ranks, None)
    try:
        RolloutWorker(cfg, ranks, parts, None).run()
    finally:
        if parts.reward is not None:
            parts.reward.close()
    return 0
