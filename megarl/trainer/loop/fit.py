"""The RL loop: one page of named steps (verl's RayPPOTrainer.fit(), on megarl's parts).

    prompts -> rollout (n each) -> rewards | old / ref log-probs, values -> advantages
            -> critic and actor updates -> weight sync -> validation, metrics, checkpoint

Every rank runs this loop with the same batch; the parts it calls split work across ranks
(rollout groups, megatron's TP x PP x DP) and hand back full-batch results. Rewards are scored
once, on rank 0, in parallel with the log-prob passes, and broadcast.
"""
from __future__ import annotations

import json
import time
import warnings
from contextlib import contextmanager

from megarl.algos.advantages import compute_advantage
from megarl.algos.dapo import DynamicSampler
from megarl.algos.kl import apply_kl_penalty
from megarl.algos.loss_fn import make_actor_loss_fn, make_critic_loss_fn
from megarl.algos.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from megarl.algos.rollout_correction import rollout_mismatch_metrics
from megarl.models.routing_replay import KEY as ROUTES
from megarl.protocol import DataProto
from megarl.reward.manager import RewardFailure
from megarl.rollout.multiturn import multiturn_metrics
from megarl.rollout.sampling import step_seed, train_sampling, val_sampling
from megarl.trainer import checkpointing
from megarl.trainer.baselines import add_reward_baselines, takes_baselines
from megarl.trainer.bypass import resolve_bypass
from megarl.trainer.faults import fault_point
from megarl.trainer.generation import broadcast_object, generate, sampling_seed
from megarl.trainer.generations import SAMPLES_KEY, dump_rollout
from megarl.trainer.out_of_memory import as_out_of_memory
from megarl.trainer.memory import PhaseMemory
from megarl.trainer.metrics import jsonable
from megarl.trainer.mfu import MFUMeter
from megarl.trainer.stopping import Stopped
from megarl.trainer.parts import TrainerParts
from megarl.trainer.step_metrics import memory_metrics, verl_step_metrics
from megarl.trainer.validation import validate


class BadStepLimit(RuntimeError):
    """Too many updates were skipped for a NaN/inf loss or grad norm."""


class RLTrainer:
    def __init__(self, cfg, ranks, parts: TrainerParts, logger):
        self.cfg, self.ranks, self.p, self.log = cfg, ranks, parts, logger
        self.step, self.bad_steps = 0, 0
        self.total_steps = parts.total_steps
        self.bypass = resolve_bypass(cfg, ranks.device)   # skip the old-log-prob pass where it is redundant
        self.actor_loss = make_actor_loss_fn(cfg, mismatch_rows=self._first_mini_batch_rows())
        self.critic_loss = make_critic_loss_fn(cfg) if parts.critic else None
        self.needs_baselines = takes_baselines(cfg.algorithm.adv_estimator)
        eos = [parts.tokenizer.eos_token_id]
        self.sampling, self.val_sampling = train_sampling(cfg.rollout, eos), val_sampling(cfg.rollout, eos)
        self.timings: dict[str, float] = {}
        self.extra: dict = {}      # metrics the steps add as they go; finish_step logs them
        self.step_was_bad = False  # an update of this step was skipped (NaN/inf)
        self.on_started = None     # called once resume() has succeeded (run.py writes the run's record)
        self.saved_step = -1       # the step save() last wrote
        self.stop = None           # a StopRequest (megarl/trainer/stopping.py): SIGTERM saves at a step boundary
        self.memory = PhaseMemory(ranks.device)          # memory/<phase>_peak_gb, like timing_s/<phase>
        self.mfu = MFUMeter.from_parts(cfg, parts, ranks.world, ranks.device)
        self.pending_record: str | None = None     # the step's metrics while its checkpoint is written

    # -- the loop ------------------------------------------------------------------------------------
    def fit(self) -> None:
        self.resume()
        self.sync_weights()
        if self.cfg.trainer.val_only:    # evaluation only: the loaded weights validated at their step
            return self.log_metrics(self.step, self.validate())
        if self.cfg.trainer.val_before_train and self.step == 0:
            self.log_metrics(0, self.validate())
        while self.step < self.total_steps:
            self.step += 1
            self.timings = {}
            with self.timed("step"):
                with self.timed("gen"):
                    batch = self.rollout(self.p.train_loader.next_batch())
                self.train_on(batch)
                with self.timed("sync"):
                    self.sync_weights()
            self.finish_step(batch)
            if self.stop is not None and self.step < self.total_steps and self.stop.agreed(self.ranks.group,
                                                                                         self.ranks.device):
                self.stop_here()

    def stop_here(self) -> None:
        """Save this step (unless save_freq just did) and leave the loop with one line to say so."""
        root = self.cfg.trainer.default_local_dir
        if self.saved_step != self.step:
            self.save()
        raise Stopped(f"stopped by {self.stop.name} after step {self.step} of {self.total_steps}; saved "
                      f"{checkpointing.step_dir(root, self.step)}; the same command resumes there")

    def train_on(self, batch: DataProto) -> None:
        """Everything between a rollout and the weight sync; the async loop (fit_async.py) shares it."""
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
    def rollout(self, prompts: DataProto) -> DataProto:
        """n responses per prompt; with DAPO's dynamic sampling, more rounds until enough groups vary."""
        batch = self._sample(prompts)
        if self.cfg.rollout.free_cache_engine:
            self.p.rollout.sleep()   # the trainer's passes get the KV cache's memory back
        self.handoff("trainer")
        return batch

    @property
    def sampling_seed(self) -> int:
        return sampling_seed(self.cfg)

    def _sample(self, prompts: DataProto) -> DataProto:
        sampling = self.sampling.with_(seed=step_seed(self.sampling_seed, self.step))
        if not self.cfg.algorithm.filter_groups.enable:
            return self._generate(prompts, sampling)
        buf = DynamicSampler(len(prompts), self.cfg.algorithm.filter_groups)
        for round_ in range(10**9):
            batch = self._generate(prompts, sampling.with_(seed=step_seed(self.sampling_seed, self.step, round_)))
            self.collect_rewards(batch, self.launch_rewards(batch))
            if buf.add(batch):
                break
            prompts = self.p.train_loader.next_batch()
        batch = buf.take()
        self.extra.update(buf.metrics())
        return batch

    def _generate(self, prompts: DataProto, sampling) -> DataProto:
        p = self.p
        batch = generate(p.rollout, prompts, sampling, self.ranks, p.pad_token_id)
        if self.cfg.rollout.multi_turn.enable:
            self.extra.update(multiturn_metrics(batch))
        if self.needs_baselines:     # ReMax: a greedy response's score per prompt (megarl/trainer/baselines.py)
            add_reward_baselines(self.p, self.ranks, prompts, batch, sampling,
                                 score=lambda greedy: self.reward_result(self.launch_rewards(greedy)))
        return batch

    def launch_rewards(self, batch: DataProto):
        """Start scoring on rank 0 (in a Ray pool when reward_model.launch_reward_fn_async)."""
        if "token_level_scores" in batch.batch:
            return None    # scored already (dynamic sampling)
        if self.p.reward_model is not None:
            batch.batch["rm_scores"] = self.p.reward_model.compute_scores(batch)
        return self.p.reward.compute_async(batch) if self.p.reward is not None else None

    def compute_old_log_probs(self, batch: DataProto) -> None:
        if self.bypass.on:      # the rollout's are the old policy's (megarl/trainer/bypass.py)
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

    def sync_weights(self) -> None:
        fault_point("sync", self.step, self.global_rank)
        self.extra.update(self.p.weight_sync.sync())
        self.handoff("engine")       # after the sync, which reads the weights on the device
        if self.cfg.rollout.free_cache_engine:
            self.p.rollout.wake()

    def validate(self) -> dict:
        if self.p.val_loader is None:
            return {}
        sampling = self.val_sampling.with_(seed=step_seed(self.sampling_seed, 0, stream=1))
        return validate(self.p, self.ranks, sampling, self.cfg.trainer, self.step)

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

    def finish_step(self, batch: DataProto) -> None:
        """Dumps, validation, the checkpoint, then the step's record with timing_s/save_checkpoint as
        verl logs it. The checkpoint holds the record too: a run stopped after its save but before its
        record writes that record on resume (the step is not run again)."""
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
                metrics.update(self.validate())
        metrics = self._timing_metrics(batch, metrics)
        samples = metrics.pop(SAMPLES_KEY, None)
        if self.bad_steps > tr.max_bad_steps:
            self.log_metrics(self.step, metrics, samples)
            raise BadStepLimit(f"{self.bad_steps} steps had updates skipped for NaN/inf losses or grad norms "
                               f"(more than trainer.max_bad_steps={tr.max_bad_steps}); the last checkpoint is intact. "
                               "Lower the learning rate or check the reward, then resume")
        if tr.save_freq > 0 and (self.step % tr.save_freq == 0 or self.step == self.total_steps):
            metrics["timing_s/save_checkpoint"] = self.save_holding(metrics)
        self.log_metrics(self.step, metrics, samples)

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
                "kl_ctrl": self.p.kl_ctrl.state_dict()}

    def save(self) -> None:
        self.handoff("trainer")
        checkpointing.save(self.cfg.trainer.default_local_dir, self.step, self.p.trainable_roles(),
                           self.state_dict(), self.ranks.rank, self.cfg.trainer.max_actor_ckpt_to_keep,
                           say=self.log.info)
        self.handoff("engine")
        self.saved_step = self.step
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
