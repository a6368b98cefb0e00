"""One generate() call of the native engine (megarl/rollout/native/engine.py): the prompt queue,
continuous batching over the engine's rows and prompt groups, and the decode loop.

    groups = Scheduler(engine, prompts, sampling, seed).run()   # what NativeEngine.generate returns
    groups = Scheduler(engine, prompts, sampling, seed, pause, every, budgets, samples, prefixes).run()

Pausable: at every chunk boundary while anything is running (the call's first prompts hold a
multiple of `every` tokens, the prefill's sampled token counted), `pause(unfinished)` is asked,
`unfinished` mapping each prompt with samples still running or waiting to how many; when it
says True, every running row comes back with finish_reason "paused" and its tokens so
far, and every prompt still waiting with no tokens ("paused" too). `samples[i]` (at most
sampling.n) is how many samples prompt i gets: a stream's next batch (n samples per prompt, one
prefill each) shares the call with the single continued responses of the batch before it.
`prefixes[i][j]`, when given, is sample j's response so far: its prompt is prefilled once into
its group, the responses into their rows (Transformer.prefill_rows), and the sample goes on from
there as if never stopped (its step, so its sampling key and draws, count those tokens); only
the new tokens come back, and sampling.max_tokens bounds the whole response. `finished(i, j,
completion)`, when given, is told of each sample as it finishes (not when paused), before the
next boundary's `pause`: a stream hands finished groups over from inside the call, which goes on.

`engine` is the NativeEngine: the scheduler uses its model, KV cache, row state, decode step,
device and stats, and owns only the bookkeeping of one call.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from megarl.rollout.base import Completion, FinishReason, SamplingParams
from megarl.rollout.native import sampler
from megarl.rollout.native.rows import SPAN_UNIT, bucket


PAD_SPLIT = 1024      # padding tokens a prefill pass may waste before a long prompt starts a new pass


class Scheduler:
    """One generate() call: the queue, the active rows (0..B-1) and groups (0..G-1), the decode loop.

    Per iteration: batched prefill of as many waiting prompts as free rows, free groups (and the
    prefill token budget) allow; one decode step for all active rows; then one read of which rows
    hit a stop token (the only host sync of a step; lengths are tracked on the host). Finished
    rows' tokens and log-probs come back in one copy, the last active rows move into their
    places, and so do the last active groups into the places of groups whose samples all finished.
    """

    def __init__(self, engine, prompts, sampling: SamplingParams, seed: int, pause=None, every: int = 0,
                 budgets: list[int] | None = None, samples: list[int] | None = None,
                 prefixes: list[list[list[int]]] | None = None, finished=None, join=None):
        self.e, self.prompts, self.sp, self.seed = engine, list(prompts), sampling, seed
        self.pause, self.every, self.finished, self.join = pause, every, finished, join
        # tokens each prompt's samples may take (at most sampling.max_tokens): continued responses
        # of one stream, each with its own remaining budget, share a call
        self.limit = np.full(len(prompts), sampling.max_tokens, dtype=np.int64) if budgets is None else \
            np.minimum(np.asarray(budgets, dtype=np.int64), sampling.max_tokens)
        self.R, self.Gcap = engine.cache.rows, engine.cache.groups
        stops = sorted(sampling.stop_ids)
        self.stops = torch.tensor(stops, dtype=torch.long, device=engine.device) if stops else None
        # samples per prompt; the decode step's (group, sample) grid stays sampling.n wide
        self.ns = np.full(len(prompts), sampling.n, dtype=np.int64) if samples is None else \
            np.asarray(samples, dtype=np.int64)
        self.out: list[list[Completion | None]] = [[None] * int(k) for k in self.ns]
        self.prefixes = prefixes
        # Host mirrors. Rows 0..B-1: which (prompt, sample) each holds, its group, its step.
        self.prompt = np.zeros(self.R, dtype=np.int64)
        self.sample = np.zeros(self.R, dtype=np.int64)
        self.grp = np.zeros(self.R, dtype=np.int64)
        self.steps = np.zeros(self.R, dtype=np.int64)
        self.start = np.zeros(self.R, dtype=np.int64)     # tokens a continued row came with
        self.end = np.zeros(self.R, dtype=np.int64)       # the step at which it stops ("length")
        # Groups 0..G-1: their prompt's length and how many of its samples are still running.
        self.glen = np.zeros(self.Gcap, dtype=np.int64)
        self.live = np.zeros(self.Gcap, dtype=np.int64)
        self.B = self.G = 0
        # Weight loads that land inside the call (from pause(), between two chunks): per (prompt,
        # sample) that ran across one, the loads before its first token and the new-token counts
        # at each load, so that each token knows the weights that sampled it.
        self.loads0 = self.loads = engine.weight_loads
        self.epochs: dict[tuple[int, int], tuple[int, list[int]]] = {}

    def _admit(self, idx: list[int]) -> None:
        """Prefill prompts `idx` in one pass into groups G..G+k-1; their samples (n each, or
        `samples`) take rows B..B+M-1."""
        e, rows, dev = self.e, self.e.rows, self.e.device
        k, first, g0 = len(idx), self.B, self.G
        ns = self.ns[idx]
        M = int(ns.sum())
        last = first + M
        lens = [len(self.prompts[i]) for i in idx]
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(self.prompts[i], dtype=torch.long) for i in idx],
                                              batch_first=True).to(dev)                      # [k, P]
        lengths = torch.tensor(lens, dtype=torch.long, device=dev)
        groups = torch.arange(g0, g0 + k, device=dev)
        rec = rows.routes
        buf = rec.prefill_buffer(k, ids.shape[1]) if rec is not None else None             # R3: [k, P, L, topk]
        logits = e.model.prefill(ids, lengths, e.cache, groups, e.comm, buf)                # [k, V]
        if rec is not None:
            rec.store_prefill(g0, buf)
        counts = torch.from_numpy(ns).to(dev)
        src = torch.arange(k, device=dev).repeat_interleave(counts, output_size=M)          # [M] prompt of each row
        member = np.concatenate([np.arange(c) for c in ns])                                 # [M] sample of each row
        samples = torch.from_numpy(member).to(dev)
        rows.key[first:last] = sampler.sample_keys(self.seed, torch.tensor(idx, dtype=torch.long, device=dev)[src],
                                                   samples)
        rows.step[first:last] = 0
        rows.pos[first:last] = lengths[src]
        rows.grp[first:last] = groups[src]
        rows.member[first:last] = samples
        rows.glen[g0:g0 + k] = lengths
        if rows.seen is not None:
            V = e.args.vocab_size                 # padding scatters into an extra column, dropped
            pad = torch.arange(ids.shape[1], device=dev)[None, :] >= lengths[:, None]
            seen = torch.zeros(M, V + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, ids.masked_fill(pad, V)[src], True)
            rows.seen[first:last] = seen[:, :V]
        logits = logits[src]
        start = np.zeros(M, dtype=np.int64)
        if self.prefixes is not None:
            start = self._continue(self.prefixes, idx, first, lengths[src], max(lens), logits)
        rows.record(first, last, logits, self.sp)
        self.prompt[first:last] = np.repeat(idx, ns)
        self.sample[first:last] = member
        self.grp[first:last] = np.repeat(np.arange(g0, g0 + k), ns)
        self.start[first:last] = start
        self.end[first:last] = np.minimum(start + self.limit[self.prompt[first:last]], self.sp.max_tokens)
        self.steps[first:last] = start + 1
        self.glen[g0:g0 + k] = lens
        self.live[g0:g0 + k] = ns
        self.B, self.G = last, g0 + k
        if self.loads != self.loads0:         # admitted after a load inside the call
            for i, j in zip(self.prompt[first:last].tolist(), member.tolist()):
                self.epochs[(i, j)] = (self.loads - self.loads0, [])
        e.stats["prefills"] += k
        e.stats["prefill_batches"] += 1

    def _continue(self, prefixes: list[list[list[int]]], idx: list[int], first: int, plen: torch.Tensor,
                  longest: int, logits: torch.Tensor) -> np.ndarray:
        """Rows from `first` on hold prompts idx's samples; those with a response so far get its
        K/V, step, position and seen tokens, and their logits (in place) become the ones after
        its last token. Returns each row's response length."""
        e, rows, dev = self.e, self.e.rows, self.e.device
        done = [list(r) for i in idx for r in prefixes[i]]
        start = np.array([len(r) for r in done], dtype=np.int64)
        cont = np.flatnonzero(start)
        if not len(cont):
            return start
        at = torch.from_numpy(cont).to(dev)
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(done[j], dtype=torch.long) for j in cont],
                                              batch_first=True).to(dev)                      # [m, L]
        lens = torch.from_numpy(start[cont]).to(dev)
        where = at + first
        logits[at] = e.model.prefill_rows(ids, lens, where, rows.grp[where], plen[at], longest, e.cache, e.comm)
        rows.step[where] = lens
        rows.pos[where] = plen[at] + lens
        if rows.seen is not None:              # the repetition penalty counts the response's tokens too
            V = e.args.vocab_size
            pad = torch.arange(ids.shape[1], device=dev)[None, :] >= lens[:, None]
            seen = torch.zeros(len(cont), V + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, ids.masked_fill(pad, V), True)
            rows.seen[where] |= seen[:, :V]
        e.stats["continued"] += len(cont)
        return start

    def _retire(self, pausing: bool = False) -> None:
        """Record finished rows (every row when pausing: "paused"); move the last active rows (and
        groups) into the freed places."""
        e, rows, B = self.e, self.e.rows, self.B
        if B == 0:
            return
        stopped = np.zeros(B, dtype=bool)
        if self.stops is not None and not pausing:           # the one read-back per step
            stopped[torch.isin(rows.tok[:B], self.stops).nonzero().flatten().cpu().numpy()] = True
        done = stopped | (self.steps[:B] >= self.end[:B]) | pausing
        fin = np.flatnonzero(done)
        if not len(fin):
            return
        width = int(self.steps[fin].max())
        fin_t = torch.from_numpy(fin).to(e.device)
        toks = rows.out_tok[fin_t, :width].cpu().tolist()
        logps = rows.out_logp[fin_t, :width].cpu().tolist()
        routes = (rows.routes.take(fin_t, self.grp[fin].tolist(), self.glen[self.grp[fin]].tolist(),
                                   self.steps[fin].tolist()) if rows.routes is not None else [None] * len(fin))
        for r, t, lp, ro in zip(fin.tolist(), toks, logps, routes):
            s, b = int(self.steps[r]), int(self.start[r])
            reason: FinishReason = "paused" if pausing else "stop" if stopped[r] else "length"
            done_c = Completion(t[b:s], lp[b:s], reason, routed_experts=ro,
                                weight_epochs=self._token_epochs(int(self.prompt[r]), int(self.sample[r]), s - b))
            self.out[self.prompt[r]][self.sample[r]] = done_c
            if self.finished is not None and not pausing:    # before the next boundary's pause()
                self.finished(int(self.prompt[r]), int(self.sample[r]), done_c)
        e.stats["generated_tokens"] += int((self.steps[fin] - self.start[fin]).sum())
        np.subtract.at(self.live, self.grp[fin], 1)
        keep = B - len(fin)
        holes = fin[fin < keep]
        movers = np.flatnonzero(~done[keep:]) + keep
        if len(movers):
            e.cache.move_rows(movers.tolist(), holes.tolist(), int(self.steps[movers].max()))
            rows.move(movers.tolist(), holes.tolist())
            for a in (self.prompt, self.sample, self.grp, self.steps, self.start, self.end):
                a[holes] = a[movers]
        rows.reset(keep, B)
        self.B = keep
        self._retire_groups()

    def _retire_groups(self) -> None:
        """Groups whose samples all finished are free; the last active groups move into them."""
        G = self.G
        empty = np.flatnonzero(self.live[:G] == 0)
        if not len(empty):
            return
        keep = G - len(empty)
        holes = empty[empty < keep]
        movers = np.flatnonzero(self.live[keep:G] > 0) + keep
        if len(movers):
            e, rows = self.e, self.e.rows
            e.cache.move_groups(movers.tolist(), holes.tolist(), int(self.glen[movers].max()))
            if rows.routes is not None:
                rows.routes.move_groups(movers.tolist(), holes.tolist())
            rows.glen[torch.from_numpy(holes).to(e.device)] = rows.glen[torch.from_numpy(movers).to(e.device)]
            for a in (self.glen, self.live):
                a[holes] = a[movers]
            remap = np.arange(G)
            remap[movers] = holes
            self.grp[:self.B] = remap[self.grp[:self.B]]
            rows.grp[:self.B] = torch.from_numpy(self.grp[:self.B]).to(e.device)
            e.stats["group_moves"] += len(movers)
        self.live[keep:G] = 0
        self.G = keep

    def _step(self) -> None:
        e, B, G = self.e, self.B, self.G
        Ls = int(self.steps[:B].max())        # generated keys: the newest goes to steps - 1
        Lp = int(self.glen[:G].max())
        if e.decode.static:                   # static shapes: bucketed rows, groups and spans
            B, G = bucket(B, self.R), bucket(G, self.Gcap)
            Ls, Lp = bucket(Ls, e.cache.gen_len, SPAN_UNIT), bucket(Lp, e.cache.prompt_len, SPAN_UNIT)
        e.decode(B, (G, self.sp.n, Lp, Ls), self.sp)
        self.steps[:self.B] += 1
        e.stats["decode_steps"] += 1

    def _paused(self, made: int, queue: deque) -> bool:
        """At a chunk boundary (the first prompts hold `made` tokens, a multiple of `every`) with
        anything still running, ask pause(unfinished samples per prompt); on True every running
        row and waiting prompt comes back "paused"."""
        if self.pause is None or made % self.every or not (self.B or queue):
            return False
        unfinished = {i: int(self.ns[i]) for i in queue}
        for i, count in zip(*np.unique(self.prompt[:self.B], return_counts=True)):
            unfinished[int(i)] = int(count)
        if not self.pause(unfinished):
            self._note_loads()
            self._join(queue)
            return False
        self._retire(pausing=True)
        for i in queue:                       # waiting prompts: no tokens yet
            self.out[i] = [Completion([], [], "paused") for _ in range(int(self.ns[i]))]
        return True

    def _note_loads(self) -> None:
        """pause() may have loaded new weights and let the call go on: the K/V computed so far stay,
        and every running row's next token is the new weights' (each row notes where it was)."""
        now = self.e.weight_loads
        if now == self.loads:
            return
        for r in range(self.B):
            base, at = self.epochs.setdefault((int(self.prompt[r]), int(self.sample[r])), (0, []))
            at += [int(self.steps[r] - self.start[r])] * (now - self.loads)
        self.loads = now

    def _join(self, queue: deque) -> None:
        """join(), asked after a pause() that let the call go on, may return more prompts and
        their sample counts: they join the queue (a stream's next batch beside the tail of the one
        before, no call ended). Each must fit the K/V cache allocated for this call (`fits_call`)."""
        got = self.join() if self.join is not None else None
        if not got:
            return
        prompts, samples = got
        if not self.e.fits_call(prompts) or len(samples) != len(prompts) or \
                not all(1 <= k <= self.sp.n for k in samples):
            raise ValueError(f"join: {len(prompts)} prompts with samples {samples} do not fit this call (prompt "
                             f"length <= {self.e.cache.prompt_len}, samples 1..{self.sp.n}); ask fits_call() first")
        k0 = len(self.prompts)
        self.prompts += [list(p) for p in prompts]
        self.ns = np.concatenate([self.ns, np.asarray(samples, dtype=np.int64)])
        self.limit = np.concatenate([self.limit, np.full(len(prompts), self.sp.max_tokens, dtype=np.int64)])
        self.out += [[None] * int(k) for k in samples]
        if self.prefixes is not None:
            self.prefixes = list(self.prefixes) + [[[] for _ in range(k)] for k in samples]
        queue.extend(range(k0, k0 + len(prompts)))
        self.e.stats["joined"] += len(prompts)

    def _token_epochs(self, prompt: int, sample: int, tokens: int) -> list[int] | None:
        got = self.epochs.get((prompt, sample))
        if got is None:
            return None
        base, at = got
        return [base + sum(a <= k for a in at) for k in range(tokens)]

    def run(self) -> list[list[Completion]]:
        budget = self.e.max_num_batched_tokens
        queue = deque(range(len(self.prompts)))
        made = 0                              # tokens the first prompts' rows hold (the prefill samples one)

        def room(prompts: int, rows: int) -> bool:   # rows and a group for the next prompt beside those
            return self.R - self.B - rows >= self.ns[queue[0]] and self.Gcap - self.G - prompts >= 1
        while queue or self.B:
            admitted = False
            while queue and room(0, 0):
                idx: list[int] = []
                taken = longest = real = 0
                while queue and room(len(idx), taken):
                    size = len(self.prompts[queue[0]])
                    padded = (len(idx) + 1) * max(longest, size)
                    # a pass is padded to its longest prompt: within the token budget, and not
                    # more than half padding (a long prompt among short ones), except in passes too
                    # small for the padding to cost more than one more pass's launches
                    wasted = padded - real - size
                    if idx and (padded > budget or (wasted > real + size and wasted > PAD_SPLIT)):
                        break
                    taken += int(self.ns[queue[0]])
                    idx.append(queue.popleft())
                    longest, real = max(longest, size), real + size
                self._admit(idx)
                admitted = True
            if admitted:
                self._retire()
                if not made:
                    made = 1
                    if self._paused(made, queue):
                        break
            if not self.B:
                continue
            self._step()
            self._retire()
            made += 1
            if self._paused(made, queue):
                break
        return self.out  # type: ignore[return-value]
