"""Configuration of the run itself (`trainer.*`): length, layout, checkpoints, logging.

Checkpoint and logging keys live here, as in verl, so users' command lines carry over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.errors import ConfigError
from megarl.config.typed import Section, require

MAX_TIMEOUT_S = 365 * 24 * 3600


@dataclass
class TrainerConfig(Section):
    project_name: str = "megarl"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int | None = None  # None: epochs x batches per epoch; 0: no step is trained
    seed: int = 1

    # Layout of the job: processes are nnodes x n_gpus_per_node (CPU slots on CPU).
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # A model over 3B parameters on CPU is refused as a launch without GPUs unless this says it is meant
    # (megarl/workers/config_checks.py check_model_on_cpu).
    allow_large_model_on_cpu: bool = False
    collective_timeout_s: float = 600.0    # a rank that waits this long on a collective fails the job
    # SIGTERM / SIGUSR1 (preemption, a time limit): the ranks save at the next step boundary and exit 143.
    # A step that has not ended this long after the signal is given up: exit 143, no save.
    stop_grace_s: float = 300.0

    # Checkpoints.
    save_freq: int = -1                    # every N steps; -1 = never
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    max_actor_ckpt_to_keep: int | None = None  # None: keep all
    # verl's key, accepted; a step dir holds every role, so the actor's count prunes
    max_critic_ckpt_to_keep: int | None = None

    # Validation and logging.
    test_freq: int = -1
    val_before_train: bool = True
    # Evaluation only: validate the loaded (or resumed) weights, log val/* at that step and exit 0,
    # training nothing (whatever val_before_train says).
    val_only: bool = False
    logger: str | list[str] = field(default_factory=lambda: ["console"])  # console, tensorboard, wandb (one or a list)
    log_dir: str | None = None             # None: <default_local_dir>
    plot_reward_curve: bool = True
    # verl's generation dumps: <dir>/<step>.jsonl of each step's rollouts / each validation's samples
    # (megarl/trainer/metrics/generations.py); a relative path is taken from the working directory, as verl does
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    log_val_generations: int = 0           # N validation samples per validation to val_generations.jsonl, wandb, TB

    # Bad steps: a NaN/inf loss or grad norm skips that update; the run stops after this many.
    max_bad_steps: int = 3

    # MFU (perf/mfu/<role>): one device's peak TFLOP/s; null: looked up by GPU name (megarl/trainer/metrics/mfu.py)
    peak_tflops: float | None = None

    def __post_init__(self):
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        for name in self.logger:
            require(name in ("console", "tensorboard", "wandb", "jsonl"), "logger",
                    f"unknown logger {name!r}; use console, tensorboard or wandb")
        require(self.total_epochs >= 1, "total_epochs", "must be >= 1")
        require(self.total_training_steps is None or self.total_training_steps >= 0,
                "total_training_steps", "must be >= 0 (0: train no step) or null (epochs x batches per epoch)")
        require(self.nnodes >= 1, "nnodes", "must be >= 1")
        require(self.n_gpus_per_node >= 1, "n_gpus_per_node", "must be >= 1")
        require(self.save_freq == -1 or self.save_freq >= 1, "save_freq", "must be -1 (never) or >= 1")
        require(self.test_freq == -1 or self.test_freq >= 1, "test_freq", "must be -1 (never) or >= 1")
        require(self.resume_mode != "resume_path" or bool(self.resume_from_path), "resume_from_path",
                "resume_mode=resume_path needs resume_from_path=<checkpoint step directory>")
        require(self.max_bad_steps >= 0, "max_bad_steps", "must be >= 0")
        require(self.log_val_generations >= 0, "log_val_generations", "must be >= 0 (0: none)")
        require(self.peak_tflops is None or self.peak_tflops > 0, "peak_tflops",
                "must be > 0 (TFLOP/s of one device) or null")
        require(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0 seconds")
        # torch turns it into a timedelta and gloo/NCCL into a deadline on a clock counted in
        # nanoseconds: inf or 1e30 overflows on every rank; a year is already "never" for a collective.
        require(self.collective_timeout_s <= MAX_TIMEOUT_S, "collective_timeout_s",
                f"must be a finite number of seconds up to {MAX_TIMEOUT_S} (a year)")
        require(self.stop_grace_s > 0, "stop_grace_s", "must be > 0 seconds")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node


def check_val_only(cfg) -> None:
    """trainer.val_only needs something to validate, in the loop that runs validation itself."""
    if not cfg.trainer.val_only:
        return
    if not cfg.data.val_files:
        raise ConfigError("evaluates data.val_files, which is empty; set data.val_files=<file.jsonl|.parquet>",
                          "trainer.val_only")
    if cfg.rollout.placement == "disaggregated":
        raise ConfigError("is not supported with rollout.placement=disaggregated (its rollout ranks validate "
                          "between steps); use placement=colocated", "trainer.val_only")


@dataclass
class AsyncTrainingConfig(Section):
    """`async_training.*`: used with `actor_rollout_ref.rollout.placement=disaggregated`, where the
    engine on its own ranks generates ahead while the trainer updates on batch k
    (megarl/trainer/stream/fit.py). Names after verl's fully-async recipe where it has one."""
    # A sample is stale when its oldest token was sampled more than this many policy versions
    # before the weights the trainer updates (AReaL's max_head_offpolicyness). The rollout ranks
    # generate up to max(1, max_staleness) batches ahead (megarl/trainer/stream/worker.py).
    max_staleness: int = 1
    stale_samples: Literal["regenerate", "drop"] = "regenerate"  # drop: whole prompt groups leave the batch
    # verl's key: a weight update interrupts generation between token chunks; unfinished responses
    # keep their tokens and continue under the new weights (each token records its version).
    partial_rollout: bool = False
    partial_chunk_tokens: int = 4          # tokens per chunk: how often generation checks for an update
    # 0: an update lands at the first chunk boundary after the trainer signals it, where timing puts it.
    # N >= 1 (partial_rollout): the engine takes update v+1 after the N-th chunk of the last batch it
    # may start under v (or the first boundary after, once the trainer holds the batch it trains
    # v+1 on), waiting for the trainer there if need be, so two runs of one config (and a run
    # resumed from a checkpoint) repeat bitwise; the engine may wait where it could generate.
    update_at_chunk: int = 0
    # partial_rollout: the next batch starts once at most this fraction of the samples of the one
    # batch in flight are unfinished (its long tail), and both share the engine's calls; 0: a batch
    # starts when the one before is done. It saves engine steps where a step costs about the same
    # for few rows as for many (GPUs) and costs prefills (docs/async.md).
    tail_overlap: float = 0.0
    # What the trainer receives at a step. batch: one batch's prompts, every group of it, once the
    # last is done. finished_groups: the first data.train_batch_size prompt groups that are done,
    # oldest batch first, from the batches in flight (with tail_overlap, the next batch's first
    # groups stand in for the long tail's last ones, which go to a later step).
    handoff: Literal["batch", "finished_groups"] = "batch"
    # What a weight update does to responses half generated (partial_rollout). recompute: the call
    # stops and they continue under the new weights with their K/V computed again (a prefill of
    # prompt + response so far). keep: the update lands inside the engine's call and the K/V
    # computed so far stay (PipelineRL's in-flight updates): no prefill, and each token's log-prob is
    # still the one its sampler drew from, which decoupled_ppo's behaviour term uses.
    kv_after_update: Literal["recompute", "keep"] = "recompute"

    def __post_init__(self):
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0: every batch is regenerated on-policy)")
        require(not (self.max_staleness == 0 and self.stale_samples == "drop"), "stale_samples",
                "drop with max_staleness=0 drops every one-step-off-policy batch; use regenerate or max_staleness >= 1")
        require(self.partial_chunk_tokens >= 1, "partial_chunk_tokens", "must be >= 1")
        require(self.update_at_chunk >= 0, "update_at_chunk", "must be >= 0 (0: wherever the update arrives)")
        require(self.update_at_chunk == 0 or self.partial_rollout, "update_at_chunk",
                "places updates between chunks; set async_training.partial_rollout=true or update_at_chunk=0")
        require(0.0 <= self.tail_overlap <= 1.0, "tail_overlap", "must be in [0, 1] (0: off, 0.5: at half unfinished)")
        require(self.tail_overlap == 0 or self.partial_rollout, "tail_overlap",
                "starts a batch beside one half generated; set async_training.partial_rollout=true or tail_overlap=0")
        require(self.handoff == "batch" or self.tail_overlap > 0, "handoff",
                "finished_groups takes groups from the next batch, which starts in the tail of the one before; "
                "set async_training.tail_overlap > 0 (e.g. 0.5) or handoff=batch")
        require(self.kv_after_update == "recompute" or self.partial_rollout, "kv_after_update",
                "keep lands updates between chunks; set async_training.partial_rollout=true or "
                "kv_after_update=recompute")
