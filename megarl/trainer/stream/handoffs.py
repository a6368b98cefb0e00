"""async_training.handoff=finished_groups on the rollout ranks (megarl/trainer/stream/worker.py): which
finished groups every rank agrees are ready, the hand-off made at a chunk boundary inside the shared
engine call, and the groups a step takes (megarl/trainer/stream/groups.py chooses them)."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from megarl.protocol import DataProto
from megarl.trainer.stream.buffer import Pending, gather, packed
from megarl.trainer.stream.groups import choose, deferred, held_fresh, ready_mask


class GroupHandOffs:
    """RolloutWorker's finished-groups half (its attributes, as the worker sets them)."""
    p: Any
    acfg: Any
    ranks: Any
    period: Any
    buffer: deque[Pending]
    handed: int
    total: int
    in_call: bool
    _gen_from: float

    @property
    def want(self) -> int:
        raise NotImplementedError

    def _poll(self, flags: list[float]) -> list[bool]:
        raise NotImplementedError

    def _checkpoint_follows(self, step: int) -> bool:
        raise NotImplementedError

    def hand_over(self) -> None:
        raise NotImplementedError

    def _agree_ready(self, jobs: list[Pending]) -> None:
        """Each batch's finished groups not handed over, as every rollout rank agrees after a call."""
        flags = self._poll([x for job in jobs for x in ready_mask(job, job.generation.left())])
        at = 0
        for job in jobs:
            job.ready = {g for g in range(job.size) if flags[at + g]}
            at += job.size

    def _hand_over_in_call(self, jobs: list[Pending], masks: list[bool]) -> bool:
        """The hand-off at this chunk boundary, the shared call going on with its KV cache (the
        engine reports samples as they finish), so the unfinished responses are not prefilled
        again. Not where a checkpoint follows it (it saves the responses so far, which the call
        holds) or a chosen group is stale (its regeneration is an engine call of its own)."""
        if (not hasattr(self.p.rollout, "generate_pausable") or self._checkpoint_follows(self.handed)
                or self.handed + 1 >= self.total):
            return False     # (a call per chunk ends anyway; after the last step's batch none is needed)
        at = 0
        for job in jobs:                         # the ready groups as every rank agreed them
            job.ready = {g for g in range(job.size) if masks[at + g]}
            at += job.size
        chosen = choose(list(self.buffer), self.want)
        if self._poll([float(not held_fresh(chosen, self.handed, self.acfg.max_staleness, self.p.pad_token_id))])[0]:
            return False
        now = time.perf_counter()
        self.period.gen += now - self._gen_from
        self.in_call = True
        try:
            self.hand_over()
        finally:
            self.in_call = False
        self._gen_from = time.perf_counter()
        return True

    def _take_groups(self) -> tuple[DataProto, DataProto, dict]:
        """The next step's groups (groups.choose), their prompts, and what the step took."""
        chosen = choose(list(self.buffer), self.want)
        pieces, prompts = [], []
        for job, take in chosen:
            wanted = set(take)
            mine = [j for j, g in enumerate(job.rows) if int(g) in wanted]
            if mine:
                pieces.append((job.t, packed(job, mine, self.p.pad_token_id)))
            prompts.append(job.prompt_rows[take])
            job.taken |= wanted
            job.ready -= wanted
        newest = chosen[-1][0]
        extra = {"started_in_tail": float(newest.in_tail), "handoff_batches": float(len(chosen)),
                 "handoff_in_call": float(self.in_call),
                 "deferred_groups": float(deferred(list(self.buffer), newest.t))}
        self.buffer = deque(j for j in self.buffer if len(j.taken) < j.size)
        return gather(self.ranks, pieces), DataProto.concat(prompts), extra
