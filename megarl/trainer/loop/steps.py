"""The steps of an RL step, shared by both loops: everything between a rollout and the weight
sync (rewards, log-probs, values, advantages, updates), then the step's metrics, validation and
checkpoint, and the resume from one.

    steps = Steps(cfg, ranks, parts, log)
    steps.train_on(batch)          # rewards | old / ref log-probs, values -> advantages -> updates
    steps.finish_step(batch)       # dumps, validation when due, checkpoint, the step's record

The loops hold or extend these: megarl/trainer/loop/fit.py (RLTrainer: a colocated engine
generates each batch) and megarl/trainer/stream/fit.py (AsyncRLTrainer: the rollout ranks hand
batches over). Every rank runs the steps with the same batch; the parts they call split work
across ranks (megatron's TP x PP x DP) and hand back full-batch results. Rewards are scored once,
on rank 0, in parallel with the log-prob passes, and broadcast.
"""
from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

from megarl.algos.advantages import compute_advantage
from megarl.algos.kl import apply_kl_penalty
from megarl.algos.loss_fn import make_actor_loss_fn, make_critic_loss_fn
from megarl.algos.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from megarl.algos.rollout_correction import rollout_mismatch_metrics
from megarl.models.routing_replay import KEY as ROUTES
from megarl.protocol import DataProto
from megarl.reward.manager import RewardFailure
from megarl.rollout.sampling import train_sampling
from megarl.trainer.checkpoints import checkpointing
from megarl.trainer.control.faults import fault_point
from megarl.trainer.control.out_of_memory import as_out_of_memory
from megarl.trainer.loop.baselines import takes_baselines
from megarl.trainer.loop.bypass import resolve_bypass
from megarl.trainer.loop.generation import broadcast_object
from megarl.trainer.loop.parts import TrainerParts
from megarl.trainer.metrics.generations import SAMPLES_KEY, dump_rollout
from megarl.trainer.metrics.logger import jsonable
from megarl.trainer.metrics.memory import PhaseMemory
from megarl.trainer.metrics.mfu import MFUMeter
from megarl.trainer.metrics.step import memory_metrics, verl_step_metrics


class BadStepLimit(RuntimeError):
    """Too many updates were skipped for a NaN/inf loss or grad norm."""


class Carried(Protocol):
    """State a loop keeps in the steps' checkpoints beside their own (trainer_state.pt)."""

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict) -> None:
        """From the resumed checkpoint's trainer state, before the run's record is written (so a
        refusal here leaves that record as it was)."""
        ...


class Steps:
    """The steps on this rank's parts, called by a loop in its order. The loop sets `validation`
    (what a step due for testing reports) and `carried` (its own state in each checkpoint)."""

    def __init__(self, cfg, ranks, parts: TrainerParts, logger):
        self.cfg, self.ranks, self.p, self.log = cfg, ranks, parts, logger
        self.step, self.bad_steps = 0, 0
        self.total_steps = parts.total_steps
        self.bypass = resolve_bypass(cfg, ranks.device)   # skip the old-log-prob pass where it is redundant
        self.actor_loss = make_actor_loss_fn(cfg, mismatch_rows=self._first_mini_batch_rows())
        self.critic_loss = make_critic_loss_fn(cfg) if parts.critic else None
        self.needs_baselines = takes_baselines(cfg.algorithm.adv_estimator)
        self.sampling = train_sampling(cfg.rollout, [parts.tokenizer.eos_token_id])
        self.timings: dict[str, float] = {}
        self.extra: dict = {}      # metrics the steps add as they go; finish_step logs them
        self.step_was_bad = False  # an update of this step was skipped (NaN/inf)
        self.on_started = None     # called once resume() has succeeded (run.py writes the run's record)
        self.memory = PhaseMemory(ranks.device)          # memory/<phase>_peak_gb, like timing_s/<phase>
        self.mfu = MFUMeter.from_parts(cfg, parts, ranks.world, ranks.device)
        self.pending_record: str | None = None     # the step's metrics while its checkpoint is written
        # What the loop running these steps adds to them: the validation a due step runs, whether the
        # ranks agree to stop after this step (a stop signal), and state a checkpoint carries beyond the
        # steps' own (the stream's loop carries its rollout buffer).
        self.validation: Callable[[], dict] = dict
        self.stopping: Callable[[], bool] = lambda: False
        self.carried: Carried | None = None

    # -- the steps -----------------------------------------------------------------------------------
    def train_on(self, batch: DataProto) -> None:
        """Everything between a rollout and the weight sync (both loops run it)."""
        rewards = self.launch_rewards(batch)
        with self.timed("old_log_prob", not self.bypass.on):
            self.compute_old_log_probs(batch)
        if self.bypass.on:      # skipped: verl's timing_s/old_log_prob is still there, at the 0 s it took
            self.timings["old_log_prob"] = 0.0
        with self.timed("ref", self.p.ref):
            self.compute_ref_log_probs(batch)
        with self.timed("values", self.p.critic):
            self.compute_values(batch)
        with self.timed("reward"):
            self.collect_rewards(batch, rewards)
        with self.timed("adv"):
            self.compute_advantages(batch)
        with self.timed("update_critic", self.p.critic):
            self.update_critic(batch)
        with self.timed("update_actor"):
            self.update_actor(batch)
        fault_point("step", self.step, self.global_rank)

    # -- the steps -----------------------------------------------------------------------------------
    def launch_rewards(self, batch: DataProto):
        """Start scoring on rank 0 (in a Ray pool when reward_model.launch_reward_fn_async)."""
        if "token_level_scores" in batch.batch:
            return None    # scored already (dynamic sampling)
        if self.p.reward_model is not None:
            batch.batch["rm_scores"] = self.p.reward_model.compute_scores(batch)
        return self.p.reward.compute_async(batch) if self.p.reward is not None else None

    def compute_old_log_probs(self, batch: DataProto) -> None:
        if self.bypass.on:      # the rollout's are the old policy's (megarl/trainer/loop/bypass.py)
            if "rollout_log_probs" not in batch.batch:
                raise ValueError("algorithm.rollout_correction.bypass_mode: the rollout engine returned no "
                                 "log-probs; set bypass_mode=false")
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            self.extra["rollout_corr/bypass_mode"] = 1.0
            return
        if self.cfg.actor.router_replay.mode == "R2":   # the update replays the old policy's routes
            log_probs, entropy, batch.batch[ROUTES] = self.p.actor.compute_log_prob(
                batch, temperature=self.sampling.logprob_temperature, record_routes=True)
        else:
            log_probs, entropy = self.p.actor.compute_log_prob(batch, temperature=self.sampling.logprob_temperature)
        batch.batch["old_log_probs"], batch.batch["entropys"] = log_probs, entropy
        self.extra.update(rollout_mismatch_metrics(log_probs, batch.batch["rollout_log_probs"],
                                                   batch.batch["response_mask"]))

    def compute_ref_log_probs(self, batch: DataProto) -> None:
        if self.p.ref is not None:
            batch.batch["ref_log_prob"] = self.p.ref.compute_ref_log_prob(
                batch, temperature=self.sampling.logprob_temperature)

    def compute_values(self, batch: DataProto) -> None:
        if self.p.critic is not None:
            batch.batch["values"] = self.p.critic.compute_values(batch)

    def collect_rewards(self, batch: DataProto, pending) -> None:
        """Scores from rank 0 to every rank; KL in the reward and overlong shaping on top."""
        if "token_level_scores" not in batch.batch:
            result = self.reward_result(pending)
            result.apply(batch)
            self.extra.update(result.metrics)
            if result.notice:
                self.log.info(f"megarl: step {self.step}: {result.notice}")
        scores = batch.batch["token_level_scores"]
        if self.cfg.algorithm.use_kl_in_reward and "old_log_probs" in batch.batch:
            rewards, kl_metrics = apply_kl_penalty(scores, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                                                   batch.batch["response_mask"], self.p.kl_ctrl,
                                                   self.cfg.algorithm.kl_penalty)
            batch.batch["token_level_rewards"] = rewards
            self.extra.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = scores

    def reward_result(self, pending):
        """The reward's result (scored on rank 0) on every rank."""
        try:
            result = self.p.reward.result(pending) if self.p.reward is not None else None
        except RewardFailure as err:    # every rank stops naming the reward, not a peer's lost connection
            result = err
        result = broadcast_object(result)
        if isinstance(result, RewardFailure):
            raise result
        return result

    def compute_advantages(self, batch: DataProto) -> None:
        compute_advantage(batch, self.cfg.algorithm)

    def update_critic(self, batch: DataProto) -> None:
        if self.p.critic is not None:
            self._check_update("critic", self.p.critic.update_critic(batch, self.critic_loss))

    def update_actor(self, batch: DataProto) -> None:
        self.actor_loss.start_update()
        metrics = self.p.actor.update_policy(batch, self.actor_loss, temperature=self.sampling.logprob_temperature)
        self._check_update("actor", metrics)
        self.extra.update(memory_metrics(self.ranks.device))     # verl reads them after the actor's update
        self.bypass.check(metrics, self.step)

    def _first_mini_batch_rows(self) -> int:
        """Rows of the first mini-batch one DP rank's loss sees (where bypass measures the mismatch)."""
        self.log.info(f"megarl: old-log-prob pass: bypass {self.bypass.reason}")
        if not self.bypass.on:
            return 0
        return self.cfg.actor.ppo_mini_batch_size * self.cfg.rollout.n // self.cfg.data_parallel_size()

    @property
    def global_rank(self) -> int:
        return self.ranks.global_rank if self.ranks.role != "colocated" else self.ranks.rank

    def handoff(self, to: str) -> None:
        """Device memory to the rollout engine ("engine": the roles' megatron.*_offload state goes to
        host memory) or back to the trainer ("trainer")."""
        roles = self.p.trainable_roles().values()
        if to == "trainer":
            for role in roles:
                role.onload()
            return
        moved = sum(role.offload() for role in roles)
        if moved:
            self.extra["memory/offloaded_gb"] = moved / 2**30

    # -- bookkeeping ---------------------------------------------------------------------------------
    # -- bookkeeping ---------------------------------------------------------------------------------
    @contextmanager
    def timed(self, name: str, enabled=True):
        """Time a phase into timing_s/<name> and its peak memory into memory/<name>_*; phases of
        absent roles are not reported."""
        start = time.perf_counter()
        with self.memory.phase(name if enabled else None):
            try:
                yield
            except (MemoryError, RuntimeError) as err:   # out of memory: named with its phase (one line)
                raise as_out_of_memory(name, err) from err
        if enabled:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def _check_update(self, role: str, metrics: dict) -> None:
        self.extra.update(metrics)
        skipped = int(metrics.get(f"{role}/skipped_steps", 0))
        if skipped:
            self.step_was_bad = True
            warnings.warn(f"step {self.step}: {skipped} {role} update(s) skipped for a NaN/inf loss or grad norm "
                          f"(bad steps so far: {self.bad_steps + 1}, limit trainer.max_bad_steps="
                          f"{self.cfg.trainer.max_bad_steps})")

    def finish_step(self, batch: DataProto) -> bool:
        """Dumps, validation, the checkpoint, then the step's record with timing_s/save_checkpoint as
        verl logs it. The checkpoint holds the record too: a run stopped after its save but before its
        record writes that record on resume (the step is not run again). True when the ranks agreed to
        stop here: the step is saved then too, and its save time is in the record the next start reads."""
        tr = self.cfg.trainer
        metrics, self.extra = self.extra, {}
        self.bad_steps += int(self.step_was_bad)
        self.step_was_bad = False
        if self.ranks.is_main:
            with self.timed("dump_rollout_generations", bool(tr.rollout_data_dir)):
                dump_rollout(tr, self.p.tokenizer, self.step, batch)
        metrics.update(compute_data_metrics(batch, self.cfg.rollout.response_length, self.cfg.data.max_prompt_length))
        metrics.update(verl_step_metrics(self.step, batch, self.cfg.data_parallel_size()))
        metrics["training/bad_steps"] = self.bad_steps
        if tr.test_freq > 0 and (self.step % tr.test_freq == 0 or self.step == self.total_steps):
            with self.timed("testing"):
                metrics.update(self.validation())
        metrics = self._timing_metrics(batch, metrics)
        samples = metrics.pop(SAMPLES_KEY, None)
        if self.bad_steps > tr.max_bad_steps:
            self.log_metrics(self.step, metrics, samples)
            raise BadStepLimit(f"{self.bad_steps} steps had updates skipped for NaN/inf losses or grad norms "
                               f"(more than trainer.max_bad_steps={tr.max_bad_steps}); the last checkpoint is intact. "
                               "Lower the learning rate or check the reward, then resume")
        stop = self.step < self.total_steps and self.stopping()
        if stop or (tr.save_freq > 0 and (self.step % tr.save_freq == 0 or self.step == self.total_steps)):
            metrics["timing_s/save_checkpoint"] = self.save_holding(metrics)
        self.log_metrics(self.step, metrics, samples)
        return stop

    def save_holding(self, record: dict) -> float:
        """Save with the step's record in the checkpoint (for a resume after a stop before the record
        is logged); returns the seconds the save took."""
        self.pending_record = json.dumps({k: jsonable(v) for k, v in record.items()})
        start = time.perf_counter()
        self.save()
        self.pending_record = None
        seconds = time.perf_counter() - start
        fault_point("record", self.step, self.global_rank)
        return seconds

    def _timing_metrics(self, batch: DataProto, metrics: dict) -> dict:
        """`metrics` with the step's timings, throughput, MFU, padding and memory peaks."""
        metrics.update(compute_timing_metrics(batch, self.timings))
        metrics.update(compute_throughput_metrics(batch, self.timings["step"], self.ranks.world))
        metrics.update(self.mfu.metrics(batch, self.timings))
        metrics.update(self.p.padding_metrics())
        metrics.update(self.memory.metrics())
        return metrics

    def log_metrics(self, step: int, metrics: dict, samples: list | None = None) -> None:
        """One record; log_val_generations' samples (given, or in validation's metrics) to their own tables."""
        samples = metrics.pop(SAMPLES_KEY, None) or samples
        self.log.log(step, metrics)
        if samples:
            self.log.log_generations(step, samples)

    def state_dict(self) -> dict:
        return {"step": self.step, "bad_steps": self.bad_steps, "world": self.ranks.world,
                "record": self.pending_record,
                "train_loader": self.p.train_loader.sampler.state_dict(),
                "kl_ctrl": self.p.kl_ctrl.state_dict(), **(self.carried.state_dict() if self.carried else {})}

    def save(self) -> None:
        self.handoff("trainer")
        checkpointing.save(self.cfg.trainer.default_local_dir, self.step, self.p.trainable_roles(),
                           self.state_dict(), self.ranks.rank, self.cfg.trainer.max_actor_ckpt_to_keep,
                           say=self.log.info)
        self.handoff("engine")
        self.log.info(f"megarl: saved step {self.step} to "
                      f"{checkpointing.step_dir(self.cfg.trainer.default_local_dir, self.step)}")

    def resume(self) -> None:
        """Continue from the checkpoint trainer.resume_mode names (if any), then `on_started`: the
        run directory's record of this launch is written only once its resume has succeeded."""
        self._resume()
        if self.on_started is not None:
            self.on_started()

    def _resume(self) -> None:
        root = self.cfg.trainer.default_local_dir
        if self.ranks.is_main:
            for name in checkpointing.clean_partial(root):
                self.log.info(f"megarl: removed an incomplete save: {name}")
            for step in checkpointing.incomplete_steps(root):
                self.log.info(f"megarl: skipped {checkpointing.step_dir(root, step)}: no trainer_state.pt, an "
                              "incomplete save (kept; a new save of that step moves it aside)")
        path = checkpointing.resume_dir(self.cfg)
        if path is None:
            if self.ranks.is_main:
                self.log.truncate_after(-1)   # a fresh start: records of an earlier run here are stale
            return
        state = checkpointing.load(path, self.p.trainable_roles(), self.ranks.rank, self.ranks.world,
                                   say=self.log.info if self.ranks.is_main else None)
        self.step, self.bad_steps = state["step"], state["bad_steps"]
        self.p.train_loader.sampler.load_state_dict(state["train_loader"])
        self.p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.ranks.is_main:
            self.log.truncate_after(self.step)   # steps logged after the checkpoint run again
            if state.get("record") and not self.log.has_step(self.step):   # stopped between save and record
                self.log.log(self.step, json.loads(state["record"]), print_line=False)
        self.p.weight_sync.request_anchor("the trainer resumed from a checkpoint")   # delta syncs: the next is full
        self.log.info(f"megarl: resumed from {path} at step {self.step}")
        notice = checkpointing.rng_notice(state, self.ranks.world)
        if notice and self.ranks.is_main:
            self.log.info(notice)
        if self.carried is not None:
            self.carried.load_state_dict(state)
