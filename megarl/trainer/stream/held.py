"""The rollout stream's buffer in a checkpoint (megarl/trainer/stream/worker.py): each batch in
flight as plain data with every rollout DP rank's responses so far, and the buffer restored from
it on resume, in order, with the groups already handed over."""
from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist

from megarl.config.errors import ConfigError
from megarl.trainer.stream.buffer import Pending
from megarl.trainer.stream.groups import saved_ready


class HeldState:
    """RolloutWorker's checkpoint half (its attributes, as the worker sets them)."""
    ranks: Any
    handed: int
    version: int

    @property
    def groups(self) -> bool:
        raise NotImplementedError

    def _chunked(self, job: Pending) -> None:
        raise NotImplementedError

    def _partial_state(self, job: Pending) -> dict:
        """A batch in flight as plain data: its prompts and every rollout DP rank's responses so far."""
        r, gens = self.ranks, [job.generation.state_dict()]
        if r.world > 1:
            shares: list = [None] * r.world
            dist.all_gather_object(shares, (r.rollout_dp_rank, gens[0]) if r.rollout_tp_rank == 0 else None,
                                   group=r.group)
            gens = [gen for _, gen in sorted((s for s in shares if s is not None), key=lambda s: s[0])]
        return {"t": job.t, "prompts": job.prompts, "loader": job.loader, "version": job.version,
                "chunks": job.chunks, "in_tail": job.in_tail, "gens": gens, "taken": sorted(job.taken)}

    def _restore_buffer(self, ahead: list, partial: list | dict) -> deque[Pending]:
        """The checkpoint's finished batches and those it was generating, in order. With partial
        rollouts a batch may finish before the one started ahead of it, so each batch in flight
        keeps its number and the finished ones fill the places left."""
        if isinstance(partial, dict):            # saved when one batch at most was in flight: after the rest
            partial = [{"t": self.handed + 1 + len(ahead), **partial}]
        taken = {state["t"] for state in partial}
        free = (t for t in range(self.handed + 1, self.handed + 1 + len(ahead) + len(partial)) if t not in taken)
        jobs = [Pending(t, None, loader, -1, batch=batch, finished=True) for (batch, loader), t in zip(ahead, free)]
        jobs += [self._restore(state["t"], state) for state in partial]
        return deque(sorted(jobs, key=lambda j: j.t))

    def _restore(self, t: int, state: dict) -> Pending:
        if len(state["gens"]) != self.ranks.rollout_dp:
            raise ConfigError(f"the checkpoint's batch in flight was generated over {len(state['gens'])} rollout "
                              f"DP ranks, this run has {self.ranks.rollout_dp}; resume with as many rollout ranks",
                              "actor_rollout_ref.rollout.disaggregated_ranks")
        job = Pending(t, state["prompts"], state["loader"], state["version"], chunks=state["chunks"],
                      in_tail=state.get("in_tail", False), taken=set(state.get("taken", ())))
        self._chunked(job)
        dp = self.ranks.rollout_dp_rank
        job.generation.load_state_dict(state["gens"][dp], self.version, f"the batch {t}'s gens[{dp}]")
        if self.groups:
            job.finished, job.ready = saved_ready(state["gens"], job.size, job.generation.n, job.taken)
        return job
