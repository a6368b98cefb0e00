"""The loop on the rollout ranks of a disaggregated run: generate ahead into a bounded buffer,
take weight updates between generations (or between chunks), hand the oldest finished batch over.

    RolloutWorker(cfg, ranks, parts, logger).run()

Batch t is trained by the trainer holding version t-1. With k = async_training.max_staleness
(depth max(1, k)), generation of batch t may start once the engine holds version >= t-1-depth, so
at most `depth` batches are generated (or being generated) ahead of the one the trainer needs,
and no sample is more than k versions old when it is trained on. The rest of the buffer is
finished batches waiting for their hand-off.

    loop: hand batch h over       when the engine holds version h-1 and batch h is finished
          or start batch t        when no generation is in flight and version >= t-1-depth
          or advance what is in flight (a whole batch, or with partial_rollout one chunk, on a
             pausable engine as many chunks as pass until a round stops it), taking an update
             when the trainer has signalled one (with update_at_chunk=N: after chunk N of batch
             version+1+depth, the last one the engine may start, waiting for it)
          or wait for the next update (the buffer is full)

With partial rollouts and async_training.tail_overlap = f > 0, two batches may be in flight: once
at most a fraction f of the one batch's samples are unfinished on every rollout rank (its long
tail) and the buffer has room, the next batch starts and both share the engine's calls
(`step_together`), so the engine's rows are not left to the few long responses. A round stops the
shared calls when the older batch is finished and can be handed over, when an update is due, or
(one batch in flight) when the next one may start.

At depth 1 this is the one-step off-policy schedule: generate t under t-2, take update t-1,
hand t over. Hand-off h happens right after update h-1, as the trainer expects (it syncs
version h-1, then receives batch h).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megarl.algos.staleness import stale_rows
from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.base import pack_completions
from megarl.rollout.partial import ChunkedGeneration, step_together
from megarl.rollout.sampling import step_seed, train_sampling, val_sampling
from megarl.trainer.disaggregated import UpdateSignal, handoff, send_start
from megarl.trainer.faults import fault_point
from megarl.trainer.generation import generate, sampling_seed, shard_rows
from megarl.trainer.validation import validate


@dataclass
class Pending:
    """A batch of the buffer: being generated (batch is None) or finished, not handed over yet."""
    t: int
    prompts: DataProto | None             # None for a batch restored from a checkpoint
    loader: dict                          # the data position after its prompts
    version: int                          # the engine's version when its generation started (-1: restored)
    gen: ChunkedGeneration | None = None  # partial rollouts: this rank's share, advanced chunk by chunk
    chunks: int = 0                       # chunks advanced, counted alike on every rollout rank
    in_tail: bool = False                 # started while the batch before it finished its long tail
    mine: DataProto | None = None
    batch: DataProto | None = None


@dataclass
class Round:
    """One chunk boundary, agreed by every rollout rank."""
    live: list[bool]        # per batch in flight: some rank still generates it
    update: bool            # take the next weight update now
    overlap: bool           # start the next batch beside the one in flight
    stop: bool              # end the engine call here


@dataclass
class Period:
    """What the engine did between two hand-offs (logged with the second)."""
    began: float = field(default_factory=time.perf_counter)
    gen: float = 0.0
    wait_update: float = 0.0
    sync: float = 0.0

    def timing(self) -> dict[str, float]:
        return {"gen": self.gen, "wait_update": self.wait_update, "sync": self.sync}

    def idle_fraction(self) -> float:
        return self.wait_update / max(time.perf_counter() - self.began, 1e-9)


class RolloutWorker:
    def __init__(self, cfg, ranks, parts, logger):
        self.cfg, self.ranks, self.p, self.log = cfg, ranks, parts, logger
        self.acfg = cfg.async_training
        self.depth = max(1, self.acfg.max_staleness)
        self.signal = UpdateSignal(ranks, cfg.trainer.nnodes)
        eos = [parts.tokenizer.eos_token_id]
        self.sampling, self.val_sampling = train_sampling(cfg.rollout, eos), val_sampling(cfg.rollout, eos)
        self.version = 0
        self.val: dict[int, dict] = {}
        self.total = parts.total_steps
        self.period = Period()
        self.buffer: deque[Pending] = deque()

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
        if start["step"] == 0 and self.cfg.trainer.val_before_train:
            self._validate(0)
        self.handed = start["step"] + int(start["inflight"])    # the last batch the trainer received
        self.buffer = self._restore_buffer(start.get("ahead", []), start.get("partial") or [])
        self.next_t = self.handed + 1 + len(self.buffer)
        self.period = Period()
        while self.handed <= self.total:                          # hand-off total+1 is the closing None
            self.serve()

    def serve(self) -> None:
        """One move of the loop (module docstring)."""
        h = self.handed + 1
        head = self.buffer[0] if self.buffer else None
        if self.version >= h - 1 and (h > self.total or (head is not None and head.batch is not None)):
            return self.hand_over()
        jobs = self._in_flight()
        if not jobs and self._may_start():
            jobs = [self.start(self.next_t)]
        if not jobs:
            return self._take_update()           # the buffer is full: wait for the trainer
        self.advance(jobs)

    def _in_flight(self) -> list[Pending]:
        return [j for j in self.buffer if j.batch is None]

    def _may_start(self) -> bool:
        return self.next_t <= self.total and self.version >= self.next_t - 1 - self.depth

    # -- the buffer ----------------------------------------------------------------------------------
    def start(self, t: int) -> Pending:
        prompts = self.p.train_loader.next_batch()
        job = Pending(t, prompts, self.p.train_loader.sampler.state_dict(), self.version)
        if self.acfg.partial_rollout:
            self._chunked(job)
        self.buffer.append(job)
        self.next_t = t + 1
        return job

    def _chunked(self, job: Pending) -> None:
        r = self.ranks
        sampling = self._sampling(job.t)
        job.mine = job.prompts[shard_rows(len(job.prompts), r.rollout_dp, r.rollout_dp_rank)]
        job.gen = ChunkedGeneration([list(p) for p in job.mine.non_tensor_batch["prompt_token_ids"]],
                                    sampling.with_(seed=step_seed(sampling.seed or 0, 0, r.rollout_dp_rank)),
                                    self.acfg.partial_chunk_tokens)

    def advance(self, jobs: list[Pending]) -> None:
        """What is in flight: a whole batch, or (partial rollouts) one or two batches chunk by chunk
        in lock-step over the rollout ranks, so every rank joins a weight sync at the same
        boundary. Lock-step is a round per chunk (`_round`), which every rollout rank joins: on a
        pausable engine from inside its generate call (the batches go on without re-submission
        until a round stops them), else after each one-chunk call; a rank whose share is done
        keeps joining rounds until every rank is done or a round stops."""
        began = time.perf_counter()
        if jobs[0].gen is None:
            job = jobs[0]
            job.batch = self.generate(job.prompts, job.t)
            self.period.gen += time.perf_counter() - began
            if self._poll([float(self.signal.arrived(self.version + 1))])[0]:
                self._take_update()
            return
        pausable = hasattr(self.p.rollout, "generate_pausable")
        gens = [j.gen for j in jobs]
        rounds: list[Round] = []

        def pause(unfinished: list[int]) -> bool:    # this rank is generating: asked at a boundary
            rounds.append(self._round(jobs, unfinished))
            return rounds[-1].stop
        if not all(g.done for g in gens):
            step_together(gens, self.p.rollout, self.version, pause if pausable else None)
        self.period.gen += time.perf_counter() - began
        if not (rounds and rounds[-1].stop):
            while True:
                rounds.append(self._round(jobs, [g.unfinished() for g in gens]))
                last = rounds[-1]
                if not pausable or last.stop or not any(last.live) or not all(g.done for g in gens):
                    break                        # (this rank still generating: back to its engine)
        last = rounds[-1]
        if last.update:
            self._take_update()                  # interrupts every unfinished sequence here
        for job, live in zip(jobs, last.live):
            if not live:
                job.batch = self._finish_partial(job)
                job.batch.meta_info["started_in_tail"] = float(job.in_tail)   # kept in checkpoints
        if last.overlap and self._may_start():
            self.start(self.next_t).in_tail = True

    def _round(self, jobs: list[Pending], unfinished: list[int]) -> Round:
        """One chunk boundary, agreed by every rollout rank from what each says: how many of its
        sequences of each batch in flight are unfinished."""
        share = len(jobs[0].gen.seqs)
        tail = len(jobs) == 1 and unfinished[0] <= self.acfg.tail_overlap * share
        mine = [float(u > 0) for u in unfinished] + [0.0] * (2 - len(unfinished))
        flags = self._poll([*mine, float(self.signal.arrived(self.version + 1)), float(not tail)])
        live, arrived, tail = list(flags[:len(jobs)]), flags[2], not flags[3]
        for job in jobs:
            job.chunks += 1
        if any(live):                            # responses half done (the kill drills' point)
            for job in jobs:
                fault_point("stream", job.t, self.ranks.global_rank)
        if self.acfg.update_at_chunk:
            # the update is taken here or not at all, whenever the trainer's signal came
            arrived = any(j.chunks == self.acfg.update_at_chunk and j.t == self.version + 1 + self.depth
                          for j in jobs)
        overlap = self.acfg.tail_overlap > 0 and tail and live[0] and self._may_start()
        # the older batch is done and the trainer can take it: end the shared call to hand it over
        handoff_due = len(jobs) == 2 and not live[0] and self.version >= jobs[0].t - 1
        return Round(live, arrived, overlap, arrived or overlap or handoff_due)

    def hand_over(self) -> None:
        h = self.handed + 1
        payload = {"batch": None, "val": self.val, "loader": self.p.train_loader.sampler.state_dict()}
        if h <= self.total:
            job = self.buffer.popleft()
            started_in_tail = job.batch.meta_info.pop("started_in_tail", 0.0)
            batch, extra = self.enforce_staleness(job.batch, job.prompts, h)
            extra["started_in_tail"] = started_in_tail
            extra["buffer_ready"] = float(len(self._finished()))
            extra["engine_idle_fraction"] = self.period.idle_fraction()
            batch.meta_info["async_metrics"] = extra
            batch.meta_info["rollout_timing"] = self.period.timing()
            payload.update(batch=batch, loader=job.loader)
            if self._checkpoint_follows(h - 1):
                # the finished batches behind it go into the trainer's checkpoint, and the one in
                # flight with its responses so far, with the data position after the last of them
                ahead = [(j.batch, j.loader) for j in self._finished()]
                payload.update(ahead=ahead, partial=[self._partial_state(j) for j in self._in_flight()],
                               loader=self.buffer[-1].loader if self.buffer else job.loader)
        if self.ranks.rank == 0:
            handoff(self.ranks, payload)
        self.val, self.handed, self.period = {}, h, Period()

    def _partial_state(self, job: Pending) -> dict:
        """A batch in flight as plain data: its prompts and every rollout DP rank's responses so far."""
        r, gens = self.ranks, [job.gen.state_dict()]
        if r.world > 1:
            shares: list = [None] * r.world
            dist.all_gather_object(shares, (r.rollout_dp_rank, gens[0]) if r.rollout_tp_rank == 0 else None,
                                   group=r.group)
            gens = [gen for _, gen in sorted((s for s in shares if s is not None), key=lambda s: s[0])]
        return {"t": job.t, "prompts": job.prompts, "loader": job.loader, "version": job.version,
                "chunks": job.chunks, "in_tail": job.in_tail, "gens": gens}

    def _restore_buffer(self, ahead: list, partial: list | dict) -> deque[Pending]:
        """The checkpoint's finished batches and those it was generating, in order. With partial
        rollouts a batch may finish before the one started ahead of it, so each batch in flight
        keeps its number and the finished ones fill the places left."""
        if isinstance(partial, dict):            # saved when one batch at most was in flight: after the rest
            partial = [{"t": self.handed + 1 + len(ahead), **partial}]
        taken = {state["t"] for state in partial}
        free = (t for t in range(self.handed + 1, self.handed + 1 + len(ahead) + len(partial)) if t not in taken)
        jobs = [Pending(t, None, loader, -1, batch=batch) for (batch, loader), t in zip(ahead, free)]
        jobs += [self._restore(state["t"], state) for state in partial]
        return deque(sorted(jobs, key=lambda j: j.t))

    def _restore(self, t: int, state: dict) -> Pending:
        if len(state["gens"]) != self.ranks.rollout_dp:
            raise ConfigError(f"the checkpoint's batch in flight was generated over {len(state['gens'])} rollout "
                              f"DP ranks, this run has {self.ranks.rollout_dp}; resume with as many rollout ranks",
                              "actor_rollout_ref.rollout.disaggregated_ranks")
        job = Pending(t, state["prompts"], state["loader"], state["version"], chunks=state["chunks"],
                      in_tail=state.get("in_tail", False))
        self._chunked(job)
        job.gen.load_state_dict(state["gens"][self.ranks.rollout_dp_rank])
        return job

    def _finished(self) -> list[Pending]:
        return [j for j in self.buffer if j.batch is not None]

    def _checkpoint_follows(self, step: int) -> bool:
        """The trainer saves after `step` (fit.py's save_freq rule)."""
        tr = self.cfg.trainer
        return self.depth > 1 and tr.save_freq > 0 and (step % tr.save_freq == 0 or step == self.total)

    # -- generation with versions -------------------------------------------------------------------
    def _sampling(self, t: int, stream: int = 0):
        return self.sampling.with_(seed=step_seed(sampling_seed(self.cfg), t, stream))

    def generate(self, prompts: DataProto, t: int, stream: int = 0) -> DataProto:
        """The whole batch under the current weights, every token tagged with their version."""
        batch = generate(self.p.rollout, prompts, self._sampling(t, stream), self.ranks, self.p.pad_token_id)
        tv = torch.full_like(batch.batch["responses"], -1)
        tv[batch.batch["response_mask"] > 0] = self.version
        tv[:, 0] = self.version        # an empty response keeps the version it started under
        batch.batch["token_versions"] = tv
        return batch

    def _finish_partial(self, job: Pending) -> DataProto:
        r, out = self.ranks, None
        if len(job.mine):
            groups, versions = job.gen.completions()
            out = pack_completions(job.mine, groups, self.p.pad_token_id)
            tv = torch.full_like(out.batch["responses"], -1)
            for i, v in enumerate(versions):
                tv[i, :len(v)] = torch.tensor(v, dtype=torch.long)
                if not v:
                    tv[i, 0] = job.version
            out.batch["token_versions"] = tv
        if r.world == 1:
            return out
        gathered: list = [None] * r.world
        dist.all_gather_object(gathered, out if r.rollout_tp_rank == 0 else None, group=r.group)
        return DataProto.concat([g for g in gathered if g is not None])

    def _poll(self, flags: list[float]) -> list[bool]:
        """Each flag true on some rollout rank, agreed by all of them (one all-reduce)."""
        agreed = torch.tensor(flags, device=self.ranks.device)
        if self.ranks.world > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.ranks.group)
        return [bool(x > 0) for x in agreed.tolist()]

    # -- weight updates, validation, staleness ---------------------------------------------------
    def _take_update(self) -> None:
        start = time.perf_counter()
        version = self.signal.take(self.version + 1)
        self.period.wait_update += time.perf_counter() - start
        start = time.perf_counter()
        self.p.weight_sync.sync()
        self.period.sync += time.perf_counter() - start
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
        trained from): whole prompt groups regenerated under the current weights, or dropped.
        `dropped_tokens` counts the response tokens so thrown away (generated, never trained on)."""
        n, N = self.cfg.rollout.n, self.acfg.max_staleness
        stale = stale_rows(batch.batch["token_versions"], batch.batch["response_mask"], t - 1, N)
        groups = stale.view(-1, n).any(-1).numpy()
        rows = np.repeat(groups, n)
        metrics = {"stale_groups": float(groups.sum()), "regenerated_groups": 0.0, "dropped_groups": 0.0,
                   "dropped_tokens": float(batch.batch["response_mask"][torch.from_numpy(rows)].sum())}
        if not groups.any():
            return batch, metrics
        kept = batch[(~rows).nonzero()[0]]
        if self.acfg.stale_samples == "drop":
            metrics["dropped_groups"] = float(groups.sum())
            if not len(kept):
                raise RuntimeError(f"every sample of batch {t} is more than async_training.max_staleness={N} "
                                   "versions old; raise it or set stale_samples=regenerate")
            return kept, metrics
        fresh = self.generate(prompts[groups.nonzero()[0]], t, stream=2)
        metrics["regenerated_groups"] = float(groups.sum())
        return DataProto.concat([kept, fresh]) if len(kept) else fresh, metrics
