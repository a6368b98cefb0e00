"""async_training.handoff=finished_groups: the trainer's batch is made of whichever prompt groups
are done, not of one batch's prompts.

A batch of prompts waits for its longest response. With tail_overlap the next batch already
runs beside that tail; here its first finished groups stand in for the tail's last ones, which
stay in the buffer and go to a later step (as AReaL's and NeMo RL's ready-first buffers, and
Tinker's streaming minibatches, train groups in the order they finish). A step's groups: the
done ones of the oldest batch first, then the next batch's, each batch's in prompt order, so the
choice is a function of which groups are done at the hand-off, agreed by every rollout rank.

The bound on staleness is unchanged: every token carries its version, and a group whose oldest
token is more than max_staleness versions behind is regenerated or dropped at its hand-off
(`async/stale_groups`). A group that waits long in the tail may reach that bound.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np
import torch

from megarl.algos.staleness import stale_rows
from megarl.protocol import DataProto
from megarl.trainer.loop.generation import shard_rows
from megarl.trainer.stream.buffer import Pending, packed


class HeldBatch(Protocol):
    """What the choice reads of a batch in the rollout buffer (buffer.Pending)."""
    t: int
    rows: np.ndarray        # this rank's share: the batch's prompt indices
    taken: set[int]         # prompt indices handed over already
    ready: set[int]         # done and not taken, agreed by every rollout rank

    @property
    def size(self) -> int:  # prompts in the batch
        ...


Held = TypeVar("Held", bound=HeldBatch)


def ready_mask(job: HeldBatch, left: list[int]) -> list[float]:
    """This rank's view of a batch's groups: 1.0 where its share holds a finished group (`left`:
    unfinished samples per prompt of the share) not handed over yet. Every rank's mask, max-reduced,
    is the batch's agreed set."""
    mask = [0.0] * job.size
    for j, n_left in enumerate(left):
        g = int(job.rows[j])
        if n_left == 0 and g not in job.taken:
            mask[g] = 1.0
    return mask


def saved_ready(gens: list[dict], size: int, n: int, taken: set[int]) -> tuple[bool, set[int]]:
    """From a checkpoint's batch (every rollout DP rank's ChunkedGeneration state, in rank order):
    whether every rank is done with it, and its finished groups not handed over yet, as the ranks
    had agreed them when it was saved."""
    done: set[int] = set()
    for rank, gen in enumerate(gens):
        seqs = gen["seqs"]
        for j, g in enumerate(shard_rows(size, len(gens), rank)):
            if all(s["finish"] is not None for s in seqs[j * n:(j + 1) * n]):
                done.add(int(g))
    return len(done) == size, done - taken


def choose(jobs: Sequence[Held], want: int) -> list[tuple[Held, list[int]]]:
    """The next step's groups: `want` of the ready ones, oldest batch first, in prompt order
    within a batch. Fewer than `want` ready: none (the step waits)."""
    if sum(len(j.ready) for j in jobs) < want:
        return []
    chosen: list[tuple[Held, list[int]]] = []
    left = want
    for job in sorted(jobs, key=lambda j: j.t):
        take = sorted(job.ready)[:left]
        if take:
            chosen.append((job, take))
            left -= len(take)
        if not left:
            break
    return chosen


def held_fresh(chosen: Sequence[tuple[Pending, list[int]]], version: int, max_staleness: int,
               pad_token_id: int) -> bool:
    """Whether this rank holds every sample of its share of the chosen groups (an engine that
    reports samples only at its call's end has not given them yet) and none is more than
    max_staleness versions behind `version`: then a hand-off may happen inside the shared call."""
    for job, take in chosen:
        wanted = set(take)
        rows = [j for j, g in enumerate(job.rows) if int(g) in wanted]
        if not rows:
            continue
        left = job.generation.left()
        if any(left[j] for j in rows):
            return False
        b = packed(job, rows, pad_token_id).batch
        if stale_rows(b["token_versions"], b["response_mask"], version, max_staleness).any():
            return False
    return True


def deferred(jobs: Sequence[HeldBatch], newest: int) -> int:
    """After a step took groups up to batch `newest`: the groups of older batches not taken, left
    for a later step (the long tail the step did not wait for)."""
    return sum(j.size - len(j.taken) for j in jobs if j.t < newest)


__all__ = ["HeldBatch", "choose", "deferred", "held_fresh", "ready_mask", "saved_ready"]


def bound_staleness(batch: DataProto, prompts: DataProto | None, t: int, n: int, acfg,
                    regenerate: Callable[[DataProto], DataProto]) -> tuple[DataProto, dict]:
    """Batch t's prompt groups with a sample more than acfg.max_staleness versions behind version
    t-1 (the weights batch t is trained from), regenerated from their prompts (`regenerate`, under
    the current weights) or dropped (acfg.stale_samples). `dropped_tokens` counts the response
    tokens so thrown away (generated, never trained on)."""
    N = acfg.max_staleness
    stale = stale_rows(batch.batch["token_versions"], batch.batch["response_mask"], t - 1, N)
    groups = stale.view(-1, n).any(-1).numpy()
    rows = np.repeat(groups, n)
    metrics = {"stale_groups": float(groups.sum()), "regenerated_groups": 0.0, "dropped_groups": 0.0,
               "dropped_tokens": float(batch.batch["response_mask"][torch.from_numpy(rows)].sum())}
    if not groups.any():
        return batch, metrics
    kept = batch[(~rows).nonzero()[0]]
    if acfg.stale_samples == "drop":
        metrics["dropped_groups"] = float(groups.sum())
        if not len(kept):
            raise RuntimeError(f"every sample of batch {t} is more than async_training.max_staleness={N} "
                               "versions old; raise it or set stale_samples=regenerate")
        return kept, metrics
    # (a batch restored finished has no prompts, and is within the bound: the resume checks it)
    assert prompts is not None, f"batch {t} has stale groups and no prompts to regenerate them from"
    fresh = regenerate(prompts[groups.nonzero()[0]])
    metrics["regenerated_groups"] = float(groups.sum())
    return DataProto.concat([kept, fresh]) if len(kept) else fresh, metrics
