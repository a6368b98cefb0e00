"""One training run on this rank: set up ranks, build the parts, fit, clean up.

Called by `megarl-train` (megarl/train.py) on every rank started by torchrun / srun.
"""
from __future__ import annotations

import sys

from megarl.config import ConfigError
from megarl.reward.manager import RewardFailure
from megarl.rollout.multiturn.executor import UserCodeExit
from megarl.trainer.checkpoints.checkpointing import CheckpointSaveError
from megarl.parallel.lifecycle import tell_launcher
from megarl.parallel.own_lines import own_line
from megarl.trainer.loop.fit import RLTrainer
from megarl.trainer.loop.steps import BadStepLimit
from megarl.trainer.stream.fit import AsyncRLTrainer
from megarl.trainer.stream.worker import RolloutWorker
from megarl.trainer.metrics.logger import MetricsLogger, MetricsWriteError
from megarl.trainer.control.out_of_memory import as_out_of_memory, is_out_of_memory
from megarl.job.build import build_parts, build_rollout_parts, build_trainer_parts, write_run_dir
from megarl.trainer.metrics.plot import plot_after_run
from megarl.parallel.shared_storage import check_shared_dir
from megarl.job.ranks import destroy, setup_ranks
from megarl.trainer.control.stopping import EXIT_CODE, StopRequest, Stopped


def run(cfg, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    tr = cfg.trainer
    rank, ranks = 0, None
    # Installed first, so a signal during the start-up is kept for the first step boundary. The
    # disaggregated trainer's rollout ranks have no step boundary to agree at: signals end it as before.
    stop = StopRequest(tr.stop_grace_s).install() if cfg.rollout.placement != "disaggregated" else None
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
        plan = ("trainer.val_only: validates the loaded weights, trains nothing" if tr.val_only else
                f"{parts.total_steps} steps of {cfg.data.train_batch_size} prompts x {cfg.rollout.n}")
        log.info(f"megarl: {plan}; run dir {tr.default_local_dir}")
        trainer: RLTrainer | AsyncRLTrainer
        if ranks.role == "trainer":
            trainer = AsyncRLTrainer(cfg, ranks, parts, log)
        else:
            trainer = RLTrainer(cfg, ranks, parts, log)
            trainer.stop = stop
        if ranks.is_main:   # after a successful resume: a refused one leaves the run's record as it was
            trainer.on_started = lambda: write_run_dir(cfg, tr.default_local_dir, config_path, list(overrides))
        try:
            trainer.fit()
        finally:
            if parts.reward is not None:
                parts.reward.close()
            if ranks.is_main and tr.plot_reward_curve:
                plot_after_run(tr.log_dir or tr.default_local_dir, log.info)
            log.close()
    except ConfigError as err:
        own_line(f"megarl: config error: {err}" if rank == 0 else f"megarl: rank {rank}: config error: {err}")
        if err.detail:
            print(err.detail, file=sys.stderr, flush=True)
        tell_launcher(err)
        return 2
    except (RewardFailure, CheckpointSaveError, MetricsWriteError, UserCodeExit) as err:  # one line each
        if rank == 0 or isinstance(err, (CheckpointSaveError, UserCodeExit)):   # a tool runs on its group's leader
            own_line(f"megarl: stopped: {err}")
        tell_launcher(err)
        return 3
    except Stopped as err:
        if rank == 0:
            own_line(f"megarl: {err}")
        return EXIT_CODE
    except BadStepLimit as err:
        own_line(f"megarl: stopped: {err}")
        return 3
    except (MemoryError, RuntimeError) as err:
        if is_out_of_memory(err):      # one line: which phase, what to lower (start-up where no step ran)
            line = f"rank {rank}: {as_out_of_memory('start-up', err)}"
            own_line(f"megarl: stopped: {line}")
            tell_launcher(RuntimeError(line))
            return 5
        if not _collective_timed_out(err):
            raise
        # One line instead of torch's trace: the cause is a peer (stopped, hung or far slower), not this rank.
        line = (f"rank {rank}: a collective waited past trainer.collective_timeout_s={tr.collective_timeout_s:g}s "
                "for another rank; find the rank that stopped (or raise trainer.collective_timeout_s)")
        own_line(f"megarl: stopped: {line}")
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
