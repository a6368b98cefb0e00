"""The rollout stream's buffer (megarl/trainer/stream/worker.py): its batches, the rounds that
agree each chunk boundary, and how finished groups become a batch of rows on every rank."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.rollout.base import pack_completions
from megarl.rollout.partial import ChunkedGeneration
from megarl.rollout.partial_state import listed, refuse, whole


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
    finished: bool = False                # every rollout rank is done generating it
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))   # this rank's prompt indices
    taken: set[int] = field(default_factory=set)     # handoff=finished_groups: prompts handed over
    ready: set[int] = field(default_factory=set)     # and those done, not handed over, agreed by all ranks

    @property
    def size(self) -> int:                # its prompts (groups); chunked batches keep theirs
        return len(self.prompt_rows)

    @property
    def prompt_rows(self) -> DataProto:
        assert self.prompts is not None, "a batch restored finished has no prompts"
        return self.prompts

    @property
    def generation(self) -> ChunkedGeneration:
        assert self.gen is not None, "a batch generated whole has no chunked generation"
        return self.gen

    @property
    def share(self) -> DataProto:
        assert self.mine is not None, "a batch generated whole has no share of its own"
        return self.mine


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
    updates_in_call: int = 0    # updates that stopped an engine call with responses unfinished
    waits_full: int = 0         # updates waited for with nothing to generate (the buffer full)
    updates_kept_kv: int = 0    # updates taken inside an engine call, its K/V kept (kv_after_update=keep)
    joined: int = 0             # batches that joined a running engine call (kv_after_update=keep)

    def timing(self) -> dict[str, float]:
        return {"gen": self.gen, "wait_update": self.wait_update, "sync": self.sync}

    def idle_fraction(self) -> float:
        return self.wait_update / max(time.perf_counter() - self.began, 1e-9)


def packed(job: Pending, mine: list[int], pad_token_id: int) -> DataProto:
    """This rank's prompts `mine` (indices into its share) of a chunked batch, with their
    completions, each token tagged with its version."""
    groups, versions = job.generation.completions(mine)
    out = pack_completions(job.share[mine], groups, pad_token_id)
    tv = torch.full_like(out.batch["responses"], -1)
    for i, v in enumerate(versions):
        tv[i, :len(v)] = torch.tensor(v, dtype=torch.long)
        if not v:
            tv[i, 0] = job.version
    out.batch["token_versions"] = tv
    return out


def gather(ranks, pieces: list[tuple[int, DataProto]]) -> DataProto:
    """Every rollout DP rank's (batch number, rows) on every rank, in batch then prompt order
    (each rank's share is a contiguous run of prompts)."""
    r = ranks
    shares = [(r.rollout_dp_rank, pieces)]
    if r.world > 1:
        gathered: list = [None] * r.world
        dist.all_gather_object(gathered, shares[0] if r.rollout_tp_rank == 0 else None, group=r.group)
        shares = [g for g in gathered if g is not None]
    ordered = sorted(((t, dp, rows) for dp, mine in shares for t, rows in mine), key=lambda p: (p[0], p[1]))
    return DataProto.concat([rows for _, _, rows in ordered])


def check_saved_stream(partial: list | dict, ahead: int, handed: int, next_t, version: int, total: int,
                       groups: bool = False) -> None:
    """A checkpoint's batches in flight (`partial`, beside `ahead` finished ones) and the next batch
    to start, before any is restored: numbered within the run's `total` and after the last hand-off
    (`handed`; with handoff=finished_groups a batch outlives the step that took its first groups),
    none twice, started under a version up to the saved one, counts not negative, `next_t` after
    every batch held. Each generation's own fields: ChunkedGeneration.load_state_dict."""
    if isinstance(partial, dict):            # one batch at most in flight: numbered after the rest
        partial = [{"t": handed + 1 + ahead, **partial}]
    held: set[int] = set()
    for i, state in enumerate(listed(partial, "buffer_partial")):
        where = f"buffer_partial[{i}]"
        if not isinstance(state, dict):
            raise refuse(where, f"is a {type(state).__name__}, not a dict")
        t = whole(state.get("t"), f"{where}.t", 1 if groups else handed + 1, total)
        if t in held:
            raise refuse(f"{where}.t", f"is {t}, a batch number given twice")
        held.add(t)
        whole(state.get("version"), f"{where}.version", -1, version)
        whole(state.get("chunks"), f"{where}.chunks", 0)
        if not isinstance(state.get("in_tail", False), bool):
            raise refuse(f"{where}.in_tail", f"is {state['in_tail']!r}, not true or false")
        prompts = state.get("prompts")
        if not isinstance(prompts, DataProto):
            raise refuse(f"{where}.prompts", f"is a {type(prompts).__name__}, not a batch of prompts")
        taken = [whole(g, f"{where}.taken[{j}]", 0, len(prompts) - 1)
                 for j, g in enumerate(listed(state.get("taken", []), f"{where}.taken"))]
        if len(set(taken)) != len(taken):
            raise refuse(f"{where}.taken", "names a prompt group twice")
        listed(state.get("gens"), f"{where}.gens")
    if next_t is not None:
        low = max([handed if groups else handed + ahead + len(held), *held]) + 1
        whole(next_t, "buffer_next_t", low, total + 1)


__all__ = ["Pending", "Period", "Round", "check_saved_stream", "gather", "packed"]
