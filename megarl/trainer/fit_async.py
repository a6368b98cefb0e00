"""The disaggregated, one-step off-policy loop: the engine on ranks of its own generates batch
k+1 while the trainer updates on batch k (rollout.placement=disaggregated, async_training.*).

    trainer ranks (AsyncRLTrainer, fit.py's named steps):
        batch k -> rewards | old / ref log-probs, values -> advantages -> updates
                -> update signal + weight sync (version k) -> receive batch k+1 -> metrics, checkpoint
    rollout ranks (RolloutWorker):
        generate batch k+1 under version k-1 (with partial_rollout: in chunks; the sync of version
        k happens between two chunks and the rest of the batch continues under it)
        -> weight sync (version k, if not yet) -> validation of version k when due -> hand batch k+1 over

Every response token carries the version that sampled it (`token_versions`); a sample whose
oldest token is more than async_training.max_staleness versions behind the trainer's weights is
regenerated under the current weights or dropped (async_training.stale_samples). With this
pipeline depth (one batch in flight) staleness is at most 1, so the bound acts at 0
(regenerate: an on-policy run through the same machinery).

Exact resume: the hand-off of batch k+1 happens before step k's checkpoint, which stores it
(the "in-flight batch") with the data position after its prompts. A resumed run trains on it
and the rollout side generates k+2 under version k, as the unkilled run did, so every later
step repeats exactly (partial rollouts excepted: where the sync lands between chunks depends
on timing, in any two runs).
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megarl.algos.staleness import stale_rows, staleness_metrics
from megarl.protocol import DataProto
from megarl.rollout.base import pack_completions
from megarl.rollout.partial import ChunkedGeneration
from megarl.rollout.sampling import train_sampling, val_sampling
from megarl.trainer import checkpointing
from megarl.trainer.disaggregated import UpdateSignal, handoff, send_start
from megarl.trainer.faults import fault_point
from megarl.trainer.fit import RLTrainer
from megarl.trainer.generation import generate, sampling_seed, shard_rows, step_seed
from megarl.trainer.validation import validate


class AsyncRLTrainer(RLTrainer):
    """fit.py's steps, fed by the rollout ranks instead of a colocated engine."""

    def __init__(self, cfg, ranks, parts, logger):
        super().__init__(cfg, ranks, parts, logger)
        self.next_batch: DataProto | None = None    # handed over, not trained on yet
        self.signal = UpdateSignal(ranks, cfg.trainer.nnodes)
        self.val_results: dict[int, dict] = {}

    def fit(self) -> None:
        self.resume()
        send_start(self.ranks, {"step": self.step, "loader": self.p.train_loader.sampler.state_dict(),
                                "inflight": self.next_batch is not None} if self.ranks.is_main else None)
        self.extra.update(self.p.weight_sync.sync())   # version self.step to the engine
        if self.next_batch is None:
            self.receive()
        if 0 in self.val_results:
            self.log_metrics(0, self.val_results.pop(0))
        while self.step < self.total_steps:
            self.step += 1
            self.timings = {}
            batch, self.next_batch = self.next_batch, None
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
        self.val_results.update(payload["val"])
        self.p.train_loader.sampler.load_state_dict(payload["loader"])   # saved with the in-flight batch

    def validate(self) -> dict:
        return self.val_results.pop(self.step, {})    # run by the rollout ranks on this version

    def state_dict(self) -> dict:
        return {**super().state_dict(), "inflight_batch": self.next_batch}

    def _resume(self) -> None:
        super()._resume()
        path = checkpointing.resume_dir(self.cfg)
        if path is not None:
            state = checkpointing.read_trainer_state(path)   # verified by super()._resume()
            self.next_batch = state.get("inflight_batch")


class RolloutWorker:
    """The loop on the rollout ranks: generate the next batch, take weight updates, hand over."""

    def __init__(self, cfg, ranks, parts, logger):
        self.cfg, self.ranks, self.p, self.log = cfg, ranks, parts, logger
        self.acfg = cfg.async_training
        self.signal = UpdateSignal(ranks, cfg.trainer.nnodes)
        eos = [parts.tokenizer.eos_token_id]
        self.sampling, self.val_sampling = train_sampling(cfg.rollout, eos), val_sampling(cfg.rollout, eos)
        self.version = 0
        self.val: dict[int, dict] = {}
        self.total = parts.total_steps
        self.timing: dict[str, float] = {"gen": 0.0, "wait_update": 0.0, "sync": 0.0}

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:
            print(f"megarl: rollout rank {self.ranks.global_rank} failed: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            raise

    def _run(self) -> None:
        start = send_start(self.ranks, None)
        self.p.train_loader.sampler.load_state_dict(start["loader"])
        self.version = start["step"]
        self.p.weight_sync.sync()
        tr = self.cfg.trainer
        if start["step"] == 0 and tr.val_before_train:
            self._validate(0)
        t = start["step"] + 1 + int(start["inflight"])
        while True:
            batch, self.timing = None, {"gen": 0.0, "wait_update": 0.0, "sync": 0.0}
            if t <= self.total:
                prompts = self.p.train_loader.next_batch()
                began = time.perf_counter()
                batch = self.generate(prompts, t)
                # a partial rollout's syncs (and waits) happen inside generate: not generation time
                self.timing["gen"] = time.perf_counter() - began - self.timing["sync"] - self.timing["wait_update"]
            while self.version < t - 1:            # the trainer syncs version t-1 before it needs batch t
                self._take_update()
            if batch is not None:
                batch, extra = self.enforce_staleness(batch, prompts, t)
                batch.meta_info["async_metrics"] = extra
                batch.meta_info["rollout_timing"] = self.timing
            if self.ranks.rank == 0:
                handoff(self.ranks, {"batch": batch, "val": self.val,
                                     "loader": self.p.train_loader.sampler.state_dict()})
            self.val = {}
            if t > self.total:
                return
            t += 1

    # -- generation with versions -------------------------------------------------------------------
    def generate(self, prompts: DataProto, t: int, stream: int = 0) -> DataProto:
        sampling = self.sampling.with_(seed=step_seed(sampling_seed(self.cfg), t, stream))
        if not self.acfg.partial_rollout:
            batch = generate(self.p.rollout, prompts, sampling, self.ranks, self.p.pad_token_id)
            tv = torch.full_like(batch.batch["responses"], -1)
            tv[batch.batch["response_mask"] > 0] = self.version
            tv[:, 0] = self.version        # an empty response keeps the version it started under
            batch.batch["token_versions"] = tv
            return batch
        return self._generate_partial(prompts, sampling)

    def _generate_partial(self, prompts: DataProto, sampling) -> DataProto:
        """Chunks in lock-step over the rollout ranks, so every rank joins a weight sync at the
        same boundary; a rank whose share is done runs empty rounds."""
        r = self.ranks
        mine = prompts[shard_rows(len(prompts), r.rollout_dp, r.rollout_dp_rank)]
        seed = step_seed(sampling.seed or 0, 0, r.rollout_dp_rank)
        gen = ChunkedGeneration([list(p) for p in mine.non_tensor_batch["prompt_token_ids"]],
                                sampling.with_(seed=seed), self.acfg.partial_chunk_tokens)
        start_version = self.version
        while True:
            if not gen.done:
                gen.step(self.p.rollout, self.version)
            flags = torch.tensor([float(not gen.done), float(self.signal.arrived(self.version + 1))],
                                 device=r.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=r.group)
            if flags[1] > 0:
                self._take_update()                # interrupts every unfinished sequence here
            elif flags[0] == 0:
                break
        out = None
        if len(mine):
            groups, versions = gen.completions()
            out = pack_completions(mine, groups, self.p.pad_token_id)
            tv = torch.full_like(out.batch["responses"], -1)
            for i, v in enumerate(versions):
                tv[i, :len(v)] = torch.tensor(v, dtype=torch.long)
                if not v:
                    tv[i, 0] = start_version
            out.batch["token_versions"] = tv
        if r.world == 1:
            return out
        gathered: list = [None] * r.world
        dist.all_gather_object(gathered, out if r.rollout_tp_rank == 0 else None, group=r.group)
        return DataProto.concat([g for g in gathered if g is not None])

    # -- weight updates, validation, staleness ---------------------------------------------------
    def _take_update(self) -> None:
        start = time.perf_counter()
        version = self.signal.take(self.version + 1)
        self.timing["wait_update"] += time.perf_counter() - start
        start = time.perf_counter()
        self.p.weight_sync.sync()
        self.timing["sync"] += time.perf_counter() - start
        self.version = version
        tr = self.cfg.trainer
        if tr.test_freq > 0 and (version % tr.test_freq == 0 or version == self.total):
            self._validate(version)

    def _validate(self, version: int) -> None:
        if self.p.val_loader is None:
            return
        sampling = self.val_sampling.with_(seed=step_seed(sampling_seed(self.cfg), 0, stream=1))
        self.val[version] = validate(self.p, self.ranks, sampling, self.cfg.trainer, version)

    def enforce_staleness(self, batch: DataProto, prompts: DataProto, t: int) -> tuple[DataProto, dict]:
        """Samples more than max_staleness versions behind version t-1 (the weights batch t is
        trained from): whole prompt groups regenerated under the current weights, or dropped."""
        n, N = self.cfg.rollout.n, self.acfg.max_staleness
        stale = stale_rows(batch.batch["token_versions"], batch.batch["response_mask"], t - 1, N)
        groups = stale.view(-1, n).any(-1).numpy()
        metrics = {"stale_groups": float(groups.sum()), "regenerated_groups": 0.0, "dropped_groups": 0.0}
        if not groups.any():
            return batch, metrics
        keep_rows = np.repeat(~groups, n).nonzero()[0]
        kept = batch[keep_rows]
        if self.acfg.stale_samples == "drop":
            metrics["dropped_groups"] = float(groups.sum())
            if not len(kept):
                raise RuntimeError(f"every sample of batch {t} is more than async_training.max_staleness={N} "
                                   "versions old; raise it or set stale_samples=regenerate")
            return kept, metrics
        fresh = self.generate(prompts[groups.nonzero()[0]], t, stream=2)
        metrics["regenerated_groups"] = float(groups.sum())
        return DataProto.concat([kept, fresh]) if len(kept) else fresh, metrics
