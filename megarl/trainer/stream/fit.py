"""The disaggregated asynchronous loop: the engine on ranks of its own generates ahead of the
trainer, up to async_training.max_staleness batches (rollout.placement=disaggregated, async_training.*).

    trainer ranks (AsyncRLTrainer, fit.py's named steps):
        batch k -> rewards | old / ref log-probs, values -> advantages -> updates
                -> update signal + weight sync (version k) -> receive batch k+1 -> metrics, checkpoint
    rollout ranks (RolloutWorker, megarl/trainer/rollout_stream.py):
        generate batches k+1 .. k+depth into a bounded buffer (with partial_rollout: in chunks, a
        sync landing between two chunks) -> weight sync (version k) -> validation of version k
        when due -> hand the oldest finished batch (k+1) over

Every response token carries the version that sampled it (`token_versions`); a sample whose
oldest token is more than async_training.max_staleness versions behind the trainer's weights is
regenerated under the current weights or dropped (async_training.stale_samples). The buffer's
depth is max(1, max_staleness), so the bound holds by construction for k >= 1 and acts at 0
(regenerate: an on-policy run through the same machinery).

Exact resume: the hand-off of batch k+1 happens before step k's checkpoint, which stores it
(the "in-flight batch") with the data position after its prompts. A resumed run trains on it
and the rollout side generates k+2 under version k, as the unkilled run did at depth 1, so every
later step repeats exactly. At depth > 1 the checkpoint also holds the rest of the buffer: its
finished batches and the batch in flight with its responses so far, which the resumed engine
continues under version k. Timing decides, in any two runs, where a sync lands between chunks
(partial rollouts) and, at depth > 1, which version each batch starts under, unless
async_training.update_at_chunk fixes both; then a resumed run repeats bitwise at any depth.
"""
from __future__ import annotations

from megarl.algos.staleness import staleness_metrics
from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.trainer import checkpointing
from megarl.trainer.disaggregated import UpdateSignal, handoff, send_start
from megarl.trainer.faults import fault_point
from megarl.trainer.fit import RLTrainer
from megarl.trainer.rollout_stream import RolloutWorker


class AsyncRLTrainer(RLTrainer):
    """fit.py's steps, fed by the rollout ranks instead of a colocated engine."""

    def __init__(self, cfg, ranks, parts, logger):
        super().__init__(cfg, ranks, parts, logger)
        self.next_batch: DataProto | None = None    # handed over, not trained on yet
        self.ahead: list = []                       # at a save: the rollout buffer's finished batches after it
        self.partial: list | dict | None = None     # and the batches it was generating, responses so far
        self.next_t: int | None = None              # the next batch of prompts the rollout side starts
        self.signal = UpdateSignal(ranks, cfg.trainer.nnodes)
        self.val_results: dict[int, dict] = {}

    def fit(self) -> None:
        self.resume()
        send_start(self.ranks, {"step": self.step, "loader": self.p.train_loader.sampler.state_dict(),
                                "inflight": self.next_batch is not None, "ahead": self.ahead,
                                "partial": self.partial, "next_t": self.next_t}
                   if self.ranks.is_main else None)
        self.extra.update(self.p.weight_sync.sync())   # version self.step to the engine
        if self.next_batch is None:
            self.receive()
        if 0 in self.val_results:
            self.log_metrics(0, self.val_results.pop(0))
        while self.step < self.total_steps:
            self.step += 1
            self.timings = {}
            batch, self.next_batch = self.next_batch, None
            assert batch is not None, f"no batch was handed over for step {self.step}"
            with self.timed("step"):
                self.extra.update(staleness_metrics(batch.batch["token_versions"], batch.batch["response_mask"],
                                                    self.step - 1))
                self.extra.update({f"async/{k}": v for k, v in batch.meta_info.get("async_metrics", {}).items()})
                self.extra.update({f"timing_s/rollout_{k}": v
                                   for k, v in batch.meta_info.get("rollout_timing", {}).items()})
                self.train_on(batch)
                with self.timed("sync"):
                    self.sync_weights()
                with self.timed("wait_rollout"):
                    self.receive()
            self.finish_step(batch)

    # -- the steps that differ ------------------------------------------------------------------
    def sync_weights(self) -> None:
        if self.ranks.is_main:
            self.signal.send(self.step)
        fault_point("sync", self.step, self.global_rank)     # the rollout side is inside the sync now
        self.extra.update(self.p.weight_sync.sync())

    def receive(self) -> None:
        """The next batch (None after the last step) and the validation results that came with it."""
        payload = handoff(self.ranks, None)
        self.next_batch = payload["batch"]
        self.ahead = payload.get("ahead", [])
        self.partial = payload.get("partial")
        self.next_t = payload.get("next_t")
        self.val_results.update(payload["val"])
        self.p.train_loader.sampler.load_state_dict(payload["loader"])   # saved with the in-flight batch

    def validate(self) -> dict:
        return self.val_results.pop(self.step, {})    # run by the rollout ranks on this version

    def state_dict(self) -> dict:
        return {**super().state_dict(), "inflight_batch": self.next_batch, "buffer_ahead": self.ahead,
                "buffer_partial": self.partial, "buffer_next_t": self.next_t}

    def _check_buffer_fits(self) -> None:
        """The saved buffer was generated ahead as far as this run's max_staleness lets it."""
        k = self.cfg.async_training.max_staleness
        if self.next_t is not None:
            # the rollout side resumes under version `step` holding batches up to next_t - 1, which
            # it may hold only if next_t - 1 <= step + 1 + max(1, k) (rollout_stream's start rule)
            need = self.next_t - 1 - (self.step + 1)
            if need > max(1, k):
                raise ConfigError(f"the checkpoint's buffer was generated {need} batches ahead, more than "
                                  f"max_staleness={k} allows; resume with max_staleness >= {need}",
                                  "async_training.max_staleness")
            return
        partial = self.partial if isinstance(self.partial, list) else [self.partial] if self.partial else []
        held = len(self.ahead) + len(partial)
        if held >= max(1, k):
            raise ConfigError(f"the checkpoint holds {held} batch(es) generated ahead, more than "
                              f"max_staleness={k} allows; resume with max_staleness >= {held + 1}",
                              "async_training.max_staleness")

    def _resume(self) -> None:
        super()._resume()
        path = checkpointing.resume_dir(self.cfg)
        if path is not None:
            state = checkpointing.read_trainer_state(path)   # verified by super()._resume()
            self.next_batch = state.get("inflight_batch")
            self.ahead = state.get("buffer_ahead", [])
            self.partial = state.get("buffer_partial")
            self.next_t = state.get("buffer_next_t")
            self._check_buffer_fits()
            if self.partial is not None and not self.cfg.async_training.partial_rollout:
                raise ConfigError("the checkpoint holds a batch generated in chunks, half done; resume with "
                                  "async_training.partial_rollout=true", "async_training.partial_rollout")


__all__ = ["AsyncRLTrainer", "RolloutWorker"]
