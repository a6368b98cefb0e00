"""The loop on the rollout ranks of a disaggregated run: generate ahead into a bounded buffer,
take weight updates between generations (or between chunks), hand the oldest finished batch over.

    RolloutWorker(cfg, ranks, parts, logger).run()

Batch t is trained by the trainer holding version t-1. With k = async_training.max_staleness
(depth max(1, k)), generation of batch t may start once the engine holds version >= t-1-depth, so at
most `depth` batches are generated (or being generated) ahead of the one the trainer needs, and no
sample is more than k versions old when it is trained on; the rest of the buffer is finished batches.

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

With async_training.handoff=finished_groups a hand-off is the first train_batch_size prompt groups
that are done, oldest batch first (megarl/trainer/stream/groups.py), made at the round where that
many are done and the trainer can take them, and a batch leaves the buffer when its last group is
handed over. On the built-in engine, which reports samples as they finish, the hand-off happens
inside the shared call and the call goes on with its KV cache; it stops the call (the unfinished
responses continued after it) where a checkpoint follows or a chosen group must be regenerated.
With kv_after_update=keep an update lands inside the call too (not where validation follows it):
every rank syncs at that round and the calls go on under the new weights with their K/V kept.

At depth 1 this is the one-step off-policy schedule: generate t under t-2, take update t-1, hand t
over. Hand-off h follows update h-1, as the trainer expects (it syncs version h-1, then receives h).
"""
from __future__ import annotations

import sys
import time
from collections import deque

import torch
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.rollout.cost_model import PacedSeconds, charged_as
from megarl.rollout.partial import ChunkedGeneration, step_together
from megarl.rollout.sampling import step_seed, train_sampling, val_sampling
from megarl.trainer.stream.messages import UpdateSignal, handoff, send_start
from megarl.trainer.control.faults import fault_point
from megarl.trainer.loop.generation import generate, sampling_seed, shard_rows
from megarl.trainer.stream.buffer import Pending, Period, Round, check_saved_stream, gather, packed
from megarl.trainer.stream.groups import bound_staleness, ready_mask
from megarl.trainer.stream.handoffs import GroupHandOffs
from megarl.trainer.stream.held import HeldState
from megarl.trainer.loop.validation import validate


class RolloutWorker(HeldState, GroupHandOffs):
    in_call = False                  # handing over inside a shared call (which goes on)
    _gen_from = 0.0                  # when this rank's generation time began counting

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
        check_saved_stream(start.get("partial") or [], len(start.get("ahead", [])), self.handed, start.get("next_t"),
                           self.version, self.total, self.groups)
        self.buffer = self._restore_buffer(start.get("ahead", []), start.get("partial") or [])
        self.next_t = start.get("next_t") or self.handed + 1 + len(self.buffer)
        self.period, self.paced = Period(), PacedSeconds(self.p.rollout)
        while self.handed <= self.total:                          # hand-off total+1 is the closing None
            self.serve()

    def serve(self) -> None:
        """One move of the loop (module docstring)."""
        h = self.handed + 1
        if self.version >= h - 1 and (h > self.total or self._next_ready()):
            return self.hand_over()
        jobs = self._in_flight()
        if not jobs and self._may_start():
            jobs = [self.start(self.next_t)]
        if not jobs:
            self.period.waits_full += 1
            return self._take_update()           # the buffer is full: wait for the trainer
        self.advance(jobs)

    @property
    def groups(self) -> bool:
        return self.acfg.handoff == "finished_groups"

    @property
    def want(self) -> int:
        """Prompt groups per hand-off (finished_groups): a batch's (the train loader drops short ones)."""
        return self.p.train_loader.sampler.batch_size

    def _next_ready(self) -> bool:
        if self.groups:
            return sum(len(j.ready) for j in self.buffer) >= self.want
        return bool(self.buffer) and self.buffer[0].batch is not None

    def _handoff_open(self) -> bool:
        """The trainer can take the next hand-off once it is ready (the engine holds its version)."""
        h = self.handed + 1
        return h <= self.total and self.version >= h - 1

    def _in_flight(self) -> list[Pending]:
        return [j for j in self.buffer if not j.finished]

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
        job.rows = shard_rows(job.size, r.rollout_dp, r.rollout_dp_rank)
        job.mine = job.prompt_rows[job.rows]
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
        began = self._gen_from = time.perf_counter()
        if jobs[0].gen is None:
            job = jobs[0]
            job.batch = self.generate(job.prompt_rows, job.t)
            job.finished = True
            self.period.gen += time.perf_counter() - began
            if self._poll([float(self.signal.arrived(self.version + 1))])[0]:
                self._take_update()
            return
        pausable = hasattr(self.p.rollout, "generate_pausable")
        gens = [j.generation for j in jobs]
        rounds: list[Round] = []

        def pause(left: list[list[int]]) -> bool:    # this rank is generating: asked at a boundary
            rounds.append(self._round(jobs, left, inside=True))
            return rounds[-1].stop

        def join() -> list[ChunkedGeneration]:     # the batch a round started beside the tail
            return [j.generation for j in jobs if all(j.generation is not g for g in gens)]
        if not all(g.done for g in gens):
            step_together(gens, self.p.rollout, self.version, pause if pausable else None,
                          join if self._joins() else None)
        self.period.gen += time.perf_counter() - self._gen_from     # (a hand-off inside the call moves it)
        if not (rounds and rounds[-1].stop):
            while True:
                rounds.append(self._round(jobs, [g.left() for g in gens]))
                last = rounds[-1]
                if not pausable or last.stop or not any(last.live) or not all(g.done for g in gens):
                    break                        # (this rank still generating: back to its engine)
        last = rounds[-1]
        if last.update:
            # one that stops a call with responses unfinished on some rank (agreed: the round's)
            self.period.updates_in_call += int(pausable and any(last.live))
            self._take_update()                  # interrupts every unfinished sequence here
        for job, live in zip(jobs, last.live):
            if not live:
                job.finished = True
                if not self.groups:
                    job.batch = self._finish_partial(job)
                    job.batch.meta_info["started_in_tail"] = float(job.in_tail)   # kept in checkpoints
        if self.groups:
            self._agree_ready(jobs)
        if last.overlap and self._may_start():
            self.start(self.next_t).in_tail = True

    def _round(self, jobs: list[Pending], left: list[list[int]], inside: bool = False) -> Round:
        """One chunk boundary, agreed by every rollout rank from what each says: how many of its
        samples of each batch in flight are unfinished, per prompt, and whether it asks from
        inside its engine call (`inside`: a batch may join the calls only if every rank does)."""
        unfinished = [sum(per_prompt) for per_prompt in left]
        share = len(jobs[0].generation.seqs)
        tail = len(jobs) == 1 and unfinished[0] <= self.acfg.tail_overlap * share
        mine = [float(u > 0) for u in unfinished] + [0.0] * (2 - len(unfinished))
        mask = [x for job, per_prompt in zip(jobs, left) for x in ready_mask(job, per_prompt)] if self.groups else []
        flags = self._poll([*mine, float(self.signal.arrived(self.version + 1)), float(not tail), float(not inside),
                            *mask])
        live, arrived, tail, masks = list(flags[:len(jobs)]), flags[2], not flags[3], flags[5:]
        for job in jobs:
            job.chunks += 1
        if any(live):                            # responses half done (the kill drills' point)
            for job in jobs:
                fault_point("stream", job.t, self.ranks.global_rank)
        if self.acfg.update_at_chunk:
            # the update is taken here, whenever the trainer's signal came: at the first boundary
            # from chunk N of the last batch the engine may start under this version on, once the
            # trainer holds the hand-off it trains that update on (else it would wait for it forever)
            arrived = self.handed >= self.version + 1 and any(
                j.chunks >= self.acfg.update_at_chunk and j.t == self.version + 1 + self.depth for j in jobs)
        if arrived and self._keeps_kv():         # every rank here: the calls go on under the new weights
            self._take_update(in_call=any(live))
            arrived = False
        overlap = self.acfg.tail_overlap > 0 and tail and live[0] and self._may_start()
        joins = overlap and not flags[4] and self._joins()     # every rank inside its call
        if self.groups:     # enough groups are done and the trainer can take them
            ready = sum(masks) + sum(len(j.ready) for j in self.buffer if j.finished)
            handoff_due = self._handoff_open() and ready >= self.want
            if handoff_due and not (arrived or (overlap and not joins)) and self._hand_over_in_call(jobs, masks):
                handoff_due = False          # handed over here: the shared call goes on
        else:               # the older batch is done and the trainer can take it: end the shared call
            handoff_due = len(jobs) == 2 and not live[0] and self.version >= jobs[0].t - 1
        apart = False
        if joins:           # the next batch starts now and joins the calls (step_together's join)
            job = self.start(self.next_t)
            job.in_tail, overlap = True, False
            jobs.append(job)
            live = [*live[:len(jobs) - 1], True]
            # a prompt longer than some rank's call holds: every call ends and the batch goes into the next
            apart = self._poll([float(not self.p.rollout.fits_call(job.generation.prompts))])[0]
            self.period.joined += int(not apart)
        return Round(live, arrived, overlap, arrived or overlap or handoff_due or apart)

    def hand_over(self) -> None:
        h = self.handed + 1
        payload = {"batch": None, "val": self.val, "loader": self.p.train_loader.sampler.state_dict()}
        if h <= self.total:
            prompts: DataProto | None
            if self.groups:
                batch, prompts, extra = self._take_groups()
                loader = self.p.train_loader.sampler.state_dict()
                ready = sum(len(j.ready) for j in self.buffer) / self.want
            else:
                job = self.buffer.popleft()
                assert job.batch is not None, "the buffer's head is handed over once finished"
                batch, prompts, loader = job.batch, job.prompts, job.loader
                extra = {"started_in_tail": batch.meta_info.pop("started_in_tail", 0.0)}
                ready = float(len(self._finished()))
            batch, stale = self.enforce_staleness(batch, prompts, h)
            extra.update(stale, buffer_ready=ready, engine_idle_fraction=self.period.idle_fraction(),
                         updates_in_call=float(self.period.updates_in_call), waits_full=float(self.period.waits_full),
                         updates_kept_kv=float(self.period.updates_kept_kv), joined=float(self.period.joined))
            batch.meta_info["async_metrics"] = extra
            batch.meta_info["rollout_timing"] = {**self.period.timing(), **self.paced.since()}  # + the model's split
            payload.update(batch=batch, loader=loader, next_t=self.next_t)
            if self._checkpoint_follows(h - 1):
                # the finished batches behind it go into the trainer's checkpoint, and those in
                # flight (finished_groups: every batch held) with their responses so far, with the
                # data position after the last of them
                payload.update(ahead=[(j.batch, j.loader) for j in self._finished()],
                               partial=[self._partial_state(j) for j in self.buffer if j.batch is None],
                               loader=self.p.train_loader.sampler.state_dict())
        if self.ranks.rank == 0:
            handoff(self.ranks, payload)
        self.val, self.handed, self.period = {}, h, Period()

    def _finished(self) -> list[Pending]:
        return [j for j in self.buffer if j.batch is not None]

    def _checkpoint_follows(self, step: int) -> bool:
        """The trainer saves after `step` (fit.py's save_freq rule) and the buffer holds more than
        the batch handed over (at depth 1 the rollout side regenerates the next one on resume)."""
        tr = self.cfg.trainer
        return (self.depth > 1 or self.groups) and tr.save_freq > 0 and (step % tr.save_freq == 0 or step == self.total)

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
        share = list(range(len(job.share)))
        mine = [(job.t, packed(job, share, self.p.pad_token_id))] if share else []
        return gather(self.ranks, mine)

    def _poll(self, flags: list[float]) -> list[bool]:
        """Each flag true on some rollout rank, agreed by all of them (one all-reduce)."""
        agreed = torch.tensor(flags, device=self.ranks.device)
        if self.ranks.world > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.ranks.group)
        return [bool(x > 0) for x in agreed.tolist()]

    # -- weight updates, validation, staleness ---------------------------------------------------
    def _joins(self) -> bool:
        """kv_after_update=keep: the next batch joins the engine's running call (no call ends for it)."""
        return self.acfg.kv_after_update == "keep" and hasattr(self.p.rollout, "fits_call")

    def _keeps_kv(self) -> bool:
        """kv_after_update=keep, and the update needs no engine call of its own (validation)."""
        return self.acfg.kv_after_update == "keep" and not self._validates(self.version + 1)

    def _validates(self, version: int) -> bool:
        """Taking `version` runs validation (trainer.test_freq, and the last version)."""
        tr = self.cfg.trainer
        if self.p.val_loader is None or tr.test_freq <= 0:
            return False
        return version % tr.test_freq == 0 or version == self.total

    def _take_update(self, in_call: bool = False) -> None:
        if in_call:                              # the engine waits here, not generating
            self.period.gen += time.perf_counter() - self._gen_from
            self.period.updates_kept_kv += 1
        start = time.perf_counter()
        version = self.signal.take(self.version + 1)
        self.period.wait_update += time.perf_counter() - start
        start = time.perf_counter()
        self.p.weight_sync.sync()
        self.period.sync += time.perf_counter() - start
        self.version = version
        if self._validates(version):
            self._validate(version)
        self._gen_from = time.perf_counter()

    def _validate(self, version: int) -> None:
        if self.p.val_loader is None:
            return
        sampling = self.val_sampling.with_(seed=step_seed(sampling_seed(self.cfg), 0, stream=1))
        with charged_as(self.p.rollout, "validate"):
            self.val[version] = validate(self.p, self.ranks, sampling, self.cfg.trainer, version)

    def enforce_staleness(self, batch: DataProto, prompts: DataProto | None, t: int) -> tuple[DataProto, dict]:
        """Samples more than max_staleness versions behind version t-1 (the weights batch t is
        trained from): whole prompt groups regenerated under the current weights, or dropped."""
        def regenerate(stale: DataProto) -> DataProto:
            with charged_as(self.p.rollout, "regenerate"):
                return self.generate(stale, t, stream=2)
        return bound_staleness(batch, prompts, t, self.cfg.rollout.n, self.acfg, regenerate)
