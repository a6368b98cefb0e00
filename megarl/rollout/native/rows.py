"""The active rows of the built-in engine on the device, and one decode step over them.

    rows = Rows(slots=512, groups=128, max_tokens=256, vocab=V, device=dev, penalty=False)
    step = DecodeStep(engine, graphs=True)
    step(B, (G, n, Lp, Ls), sp)   # decode + sample + record one token for rows 0..B-1

Each row's state lives in device tensors (last token, position, sample key, step, its prompt
group and sample index, the tokens and log-probs generated so far, the tokens seen for the
repetition penalty), as do the groups' prompt lengths, so a step reads nothing back to the host:
the scheduler reads only which rows hit a stop token, once per step.

CUDA graphs: a step's shapes depend on (B, G, n, Lp, Ls) alone, so on CUDA one graph is captured
per bucketed shape the first time it is needed (as vLLM and SGLang capture per batch size) and
replayed after that. The graph holds the addresses of the cache, the
row state, the weights and the RoPE table; `DecodeStep.signature()` changes when any of them is
reallocated (a bigger cache, sleep, a weight reload after sleep level 2), and the graphs are then
dropped and captured again. Off CUDA (or with enforce_eager) the same function runs eagerly.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.native import sampler
from megarl.rollout.native.routes import RouteRecord

SPAN_UNIT = 128                               # attention spans are at least this on CUDA


def bucket(x: int, cap: int, unit: int = 1) -> int:
    """The captured size that holds x: the smallest of unit * (1, 2, 3, 4, 6, 8, 12, 16, ...)
    (two sizes per octave) that is >= x, at most cap. vLLM and SGLang capture every multiple of 8
    up to their limit (67 graphs for 512 rows); here a step's shape has four sizes (rows, groups,
    prompt and generated keys), so each is bucketed geometrically, at most 1.5x padded, to keep
    the graphs captured (and captured again after a weight reload) few."""
    x = -(-x // unit)
    p = 1 << max(x - 1, 0).bit_length()           # the power of two >= x
    size = p * 3 // 4 if p >= 4 and p * 3 // 4 >= x else p
    return min(size * unit, cap)


class Rows:
    """Per-row device state (rows 0..B-1 are the active ones) and the groups' prompt lengths."""

    def __init__(self, slots: int, groups: int, max_tokens: int, vocab: int, device, penalty: bool):
        e = dict(device=device)
        self.slots, self.groups, self.max_tokens, self.vocab = slots, groups, max_tokens, vocab
        self.tok = torch.zeros(slots, dtype=torch.long, **e)         # the last token (next decode input)
        self.pos = torch.zeros(slots, dtype=torch.long, **e)         # where that token's K/V goes
        self.key = torch.zeros(slots, dtype=torch.long, **e)         # counter-RNG key of (prompt, sample)
        self.step = torch.zeros(slots, dtype=torch.long, **e)        # tokens generated so far
        self.grp = torch.full((slots,), -1, dtype=torch.long, **e)   # its prompt group (-1: parked)
        self.member = torch.zeros(slots, dtype=torch.long, **e)      # its sample index in the group
        self.glen = torch.zeros(groups, dtype=torch.long, **e)       # prompt length of each group
        self.out_tok = torch.zeros(slots, max_tokens, dtype=torch.long, **e)
        self.out_logp = torch.zeros(slots, max_tokens, dtype=torch.float32, **e)
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, **e) if penalty else None
        self.routes: RouteRecord | None = None   # R3's record when on (set by the engine; routes.py)

    def fits(self, slots: int, groups: int, max_tokens: int, penalty: bool) -> bool:
        return (self.slots >= slots and self.groups >= groups and self.max_tokens >= max_tokens
                and (self.seen is not None or not penalty))

    def tensors(self) -> list[torch.Tensor]:
        """The per-row tensors (what `move` moves)."""
        rec = (self.routes.rows, self.routes.step) if self.routes is not None else ()
        return [t for t in (self.tok, self.pos, self.key, self.step, self.grp, self.member, self.out_tok,
                            self.out_logp, self.seen, *rec) if t is not None]

    def group_tensors(self) -> list[torch.Tensor]:
        """The per-group tensors (moved by the scheduler)."""
        return [self.glen] + ([self.routes.groups] if self.routes is not None else [])

    def move(self, src: list[int], dst: list[int]) -> None:
        """Rows src -> rows dst (pairwise, disjoint), one indexed copy per tensor."""
        if not src:
            return
        s = torch.tensor(src, device=self.tok.device)
        d = torch.tensor(dst, device=self.tok.device)
        for t in self.tensors():
            t[d] = t[s]

    def reset(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 are free: park them at position 0 / step 0 and in no group, where a
        padded graph replay that runs them writes only into their own (unused) row."""
        self.pos[lo:hi] = 0
        self.step[lo:hi] = 0
        self.grp[lo:hi] = -1
        self.member[lo:hi] = 0

    def record(self, lo: int, hi: int, logits: torch.Tensor, sp: SamplingParams) -> None:
        """Sample rows lo..hi-1's next token from logits [hi-lo, V]; append it and its log-prob."""
        u = sampler.uniforms(self.key[lo:hi], self.step[lo:hi])
        seen = self.seen[lo:hi] if self.seen is not None and sp.repetition_penalty != 1.0 else None
        tok, logp = sampler.sample(logits, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                   greedy=sp.greedy, u=u, seen=seen, repetition_penalty=sp.repetition_penalty)
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        rows = torch.arange(lo, hi, device=tok.device)
        col = self.step[lo:hi].clamp(max=self.max_tokens - 1)     # parked rows of a padded replay
        self.out_tok[rows, col] = tok
        self.out_logp[rows, col] = logp
        self.tok[lo:hi] = tok
        self.step[lo:hi] += 1


class DecodeStep:
    """decode + sample + record for rows 0..B-1: a CUDA graph per (B, shape) on CUDA, else eager."""

    def __init__(self, engine, graphs: bool):
        # A proxy, not a reference: engine <-> step would be a cycle, and a dropped engine's
        # weights and KV cache would stay resident until the next garbage collection.
        self.e = weakref.proxy(engine)
        self.graphs_on = graphs and engine.device.type == "cuda"
        # Static shapes (bucketed batch, rounded span, parked padding rows) go with graphs; a
        # test may set this on CPU to run the padded path eagerly and compare it with the exact one.
        self.static = self.graphs_on
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._sig: tuple = ()
        self.pool: Any = None                 # the graphs' memory pool handle
        self.stats = {"captured": 0, "replayed": 0, "eager": 0}
        self.shapes: set[tuple] = set()       # distinct static step shapes seen (graphs to capture)

    def signature(self) -> tuple:
        """Addresses and shapes a captured graph depends on."""
        e = self.e
        rope = e.model.rope(1)
        return (tuple(t.data_ptr() for t in e.cache.tensors()), e.cache.shape,
                tuple((t.data_ptr(), t.shape) for t in e.rows.tensors() + e.rows.group_tensors()),
                (rope[0].data_ptr(), rope[1].data_ptr(), rope[0].shape[0]),
                tuple(p.data_ptr() for p in e.params.values()))

    def drop(self) -> None:
        self.graphs.clear()
        self.pool = None

    def _run(self, B: int, shape: tuple, sp: SamplingParams) -> None:
        e, rows, rec = self.e, self.e.rows, self.e.rows.routes
        logits = e.model.decode(rows.tok[:B], rows.pos[:B], rows.step[:B], rows.grp[:B], rows.member[:B],
                                rows.glen, e.cache, e.comm, shape, None if rec is None else rec.step[:B])
        if rec is not None:
            rec.store_step(B, rows.step)
        rows.pos[:B] += 1
        rows.record(0, B, logits, sp)

    def __call__(self, B: int, shape: tuple, sp: SamplingParams) -> None:
        if self.static:
            self.shapes.add((B, shape))
        if not self.graphs_on:
            self.stats["eager"] += 1
            return self._run(B, shape, sp)
        sig = self.signature()
        if sig != self._sig:
            self.drop()
            self._sig = sig
        key = (B, shape, sp.temperature, sp.top_k, sp.top_p, sp.greedy, sp.repetition_penalty)
        graph = self.graphs.get(key)
        if graph is not None:
            self.stats["replayed"] += 1
            graph.replay()
            return
        # First use of this shape: run the step for real on a side stream (this is the warm-up
        # CUDA graphs need: lazy cuBLAS / kernel initialisation happens outside the capture),
        # then capture it without executing. The counter RNG makes the step a pure function of
        # the row state, so the captured graph replays exactly what the eager step computed.
        side = torch.cuda.Stream(device=self.e.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(B, shape, sp)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # The capture records the step on rows 0..B-1 without running it; the state the eager
        # run above advanced stays as it is.
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(B, shape, sp)
        self.graphs[key] = graph
        self.stats["captured"] += 1
