"""The disaggregated asynchronous loop: the engine on ranks of its own generates ahead of the
trainer, up to async_training.max_staleness batches (rollout.placement=disaggregated, async_training.*).

    trainer ranks (AsyncRLTrainer, holding the shared steps of megarl/trainer/loop/steps.py):
        batch k -> rewards | old / ref log-probs, values -> advantages -> updates
                -> update signal + weight sync (version k) -> receive batch k+1 -> metrics, checkpoint
    rollout ranks (RolloutWorker, megarl/trainer/stream/worker.py):
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
from megarl.trainer.control.faults import fault_point
from megarl.trainer.loop.parts import TrainerParts
from megarl.trainer.loop.steps import Steps
from megarl.trainer.stream.messages import UpdateSignal, handoff, send_start


class AsyncRLTrainer:
    """The shared steps, fed by the rollout ranks instead of a colocated engine. It holds the steps
    and gives them what this loop adds: validation results from the rollout ranks, and the rollout
    buffer carried in their checkpoints (state_dict / load_state_dict)."""

    def __init__(self, cfg, ranks, parts: TrainerParts, logger):
        self.cfg, self.ranks, self.p = cfg, ranks, parts
        self.steps = Steps(cfg, ranks, parts, logger)
        self.steps.validation = self.validate
        self.steps.carried = self
        self.next_batch: DataProto | None = None    # handed over, not trained on yet
        self.ahead: list = []                       # at a save: the rollout buffer's finished batches after it
        self.partial: list | dict | None = None     # and the batches it was generating, responses so far
        self.next_t: int | None = None              # the next batch of prompts the rollout side starts
        self.signal = UpdateSignal(ranks, cfg.trainer.nnodes)
        self.val_results: dict[int, dict] = {}

    @property
    def on_started(self):
        """Called once the resume has succeeded (megarl/job/run.py writes the run's record)."""
        return self.steps.on_started

    @on_started.setter
    def on_started(self, fn) -> None:
        self.steps.on_started = fn

    def fit(self) -> None:
        s = self.steps
        s.resume()
        send_start(self.ranks, {"step": s.step, "loader": self.p.train_loader.sampler.state_dict(),
                                "inflight": self.next_batch is not None, "ahead": self.ahead,
                                "partial": self.partial, "next_t": self.next_t}
                   if self.ranks.is_main else None)
        s.extra.update(self.p.weight_sync.sync())   # version s.step to the engine
        if self.next_batch is None:
            self.receive()
        if 0 in self.val_results:
            s.log_metrics(0, self.val_results.pop(0))
        while s.step < s.total_steps:
            s.step += 1
            s.timings = {}
            batch, self.next_batch = self.next_batch, None
            assert batch is not None, f"no batch was handed over for step {s.step}"
            with s.timed("step"):
                s.extra.update(staleness_metrics(batch.batch["token_versions"], batch.batch["response_mask"],
                                                 s.step - 1))
                s.extra.update({f"async/{k}": v for k, v in batch.meta_info.get("async_metrics", {}).items()})
                s.extra.update({f"timing_s/rollout_{k}": v
                                for k, v in batch.meta_info.get("rollout_timing", {}).items()})
                s.train_on(batch)
                with s.timed("sync"):
                    self.sync_weights()
                with s.timed("wait_rollout"):
                    self.receive()
            s.finish_step(batch)

    # -- what this loop adds to the steps ---------------------------------------------------------
    def sync_weights(self) -> None:
        s = self.steps
        if self.ranks.is_main:
            self.signal.send(s.step)
        fault_point("sync", s.step, s.global_rank)     # the rollout side is inside the sync now
        s.extra.update(self.p.weight_sync.sync())

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
        return self.val_results.pop(self.steps.step, {})    # run by the rollout ranks on this version

    def state_dict(self) -> dict:
        """The rollout buffer, saved in the steps' trainer_state.pt."""
        return {"inflight_batch": self.next_batch, "buffer_ahead": self.ahead,
                "buffer_partial": self.partial, "buffer_next_t": self.next_t}

    def load_state_dict(self, state: dict) -> None:
        """The rollout buffer of the resumed checkpoint, checked against this run's settings."""
        self.next_batch = state.get("inflight_batch")
        self.ahead = state.get("buffer_ahead", [])
        self.partial = state.get("buffer_partial")
        self.next_t = state.get("buffer_next_t")
        self.check_buffer_fits(self.steps.step)
        if self.partial is not None and not self.cfg.async_training.partial_rollout:
            raise ConfigError("the checkpoint holds a batch generated in chunks, half done; resume with "
                              "async_training.partial_rollout=true", "async_training.partial_rollout")

    def check_buffer_fits(self, step: int) -> None:
        """The buffer saved at `step` was generated ahead as far as this run's max_staleness lets it."""
        k = self.cfg.async_training.max_staleness
        if self.next_t is not None:
            # the rollout side resumes under version `step` holding batches up to next_t - 1, which
            # it may hold only if next_t - 1 <= step + 1 + max(1, k) (the start rule of stream/worker.py)
            need = self.next_t - 1 - (step + 1)
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


__all__ = ["AsyncRLTrainer"]
