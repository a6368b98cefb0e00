"""Partial rollouts on any engine: generation in token chunks that a weight update can interrupt.

Engine-agnostic, on the rollout contract only (megarl/rollout/base.py): each chunk is one
`engine.generate` call with n=1 per unfinished sequence, its prompt being the original prompt
plus the response so far (as slime continues aborted samples). A weight update between two
chunks is therefore invisible to the engine: the next chunk simply runs under the new weights.
Each response token keeps the log-prob the engine reported when it was sampled and the weight
version that sampled it.

    gen = ChunkedGeneration(prompts, sampling, chunk_tokens=4)
    while not gen.done:
        gen.step(engine, version)            # one chunk for every unfinished sequence
        if update_pending(): sync(); version += 1
    groups, versions = gen.completions()     # per prompt, n Completions; per completion, a version per token

    step_together([gen, next_gen], engine, version)   # two batches' sequences in the same calls

Pausable engines (the built-in one: `generate_pausable`): given `pause`, a step is one call that
runs to the end unless `pause(left)`, asked at every chunk boundary with each generation's
unfinished samples per prompt, answers True; then the unfinished
sequences stop there and the next step re-submits them. The batch is then re-submitted only when
a weight update lands, not at every chunk (one call per chunk re-prefills prompt + response so
far: chunks of 4 cost 1.8x a whole-batch generation on a long-tailed task, docs/async.md).
Updates still land only at chunk boundaries, as before. Where the engine also continues
responses (`prefixes`: the built-in engine without R3), a re-submitted sample keeps its prompt's
group and only its response is prefilled again. Where the engine reports samples as they finish
(`finished`: the built-in engine), each joins its sequence at once, so `pause` sees its group
done and a stream hands it over at that boundary while the call goes on. A `pause` may also
load new weights into the engine and answer False (async_training.kv_after_update=keep): the call
goes on with the K/V computed so far, and each token's version is the step's `version` plus the
loads the engine counted before drawing it (Completion.weight_epochs).

R3 (routed experts): each chunk's prompt is the sequence so far, so its prefill routes every earlier
token under the weights of that chunk; a sequence keeps its latest chunk's record.

The chunk's seed is derived from the sampling seed and the chunk index, so the same sequence of
calls under the same weights gives the same tokens. Prompts that the engine's guard would
truncate are not supported: prompt + partial response must fit the engine's prompt length.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.base import Completion, FinishReason, SamplingParams
from megarl.rollout.partial_state import check_generation
from megarl.rollout.sampling import step_seed


@dataclass
class _Seq:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None    # None while unfinished
    routes: Any = None                    # R3: the latest chunk's routed_experts (its prefill covers all before)


class ChunkedGeneration:
    def __init__(self, prompts: list[list[int]], sampling: SamplingParams, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.sampling, self.chunk = sampling, chunk_tokens
        self.n = sampling.n
        self.prompts = [list(p) for p in prompts]
        self.seqs = [_Seq(list(p)) for p in prompts for _ in range(sampling.n)]
        self.chunks_done = 0

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    def step(self, engine, version: int, pause=None) -> int:
        """Generate up to chunk_tokens more for every unfinished sequence, or, on a pausable engine
        given `pause`, until the end or until pause([unfinished]) says stop; returns the tokens added."""
        return step_together([self], engine, version, pause)

    def unfinished(self) -> int:
        return sum(s.finish is None for s in self.seqs)

    def left(self) -> list[int]:
        """Per prompt, its samples still unfinished (0: the prompt's group is complete)."""
        return [sum(s.finish is None for s in self.seqs[i:i + self.n]) for i in range(0, len(self.seqs), self.n)]

    def _extend(self, s: _Seq, c: Completion, version: int, max_new: int) -> int:
        if len(c.log_probs) != len(c.token_ids):
            raise ValueError(f"engine returned {len(c.log_probs)} log-probs for {len(c.token_ids)} tokens")
        s.tokens += c.token_ids
        s.log_probs += c.log_probs
        if c.weight_epochs is not None:          # weights loaded inside the call: each token its own
            if len(c.weight_epochs) != len(c.token_ids):
                raise ValueError(f"engine returned {len(c.weight_epochs)} weight epochs for {len(c.token_ids)} tokens")
            s.versions += [version + k for k in c.weight_epochs]
        else:
            s.versions += [version] * len(c.token_ids)
        if c.routed_experts is not None:
            s.routes = c.routed_experts
        if c.finish_reason in ("stop", "abort"):
            s.finish = c.finish_reason
        elif len(s.tokens) >= self.sampling.max_tokens:
            s.finish = "length"
        elif c.finish_reason == "paused":
            pass                                 # stopped at a chunk boundary: continued next step
        elif c.finish_reason == "length" and len(c.token_ids) < max_new:
            s.finish = "length"                  # the engine's own context limit ended it
        return len(c.token_ids)

    def _extend_all(self, groups: list[list[Completion]], version: int, max_new: int) -> int:
        """A first chunk's completions, n per prompt, onto every sequence."""
        return sum(self._extend(s, c, version, max_new) for s, c in zip(self.seqs, (c for g in groups for c in g)))

    def state_dict(self) -> dict:
        """Plain data (a checkpoint's): the responses so far, their log-probs and versions. Sampling
        and chunk size come back from config; each chunk's seed is a function of its index."""
        return {"chunks_done": self.chunks_done,
                "seqs": [{"prompt": s.prompt, "tokens": s.tokens, "log_probs": s.log_probs, "versions": s.versions,
                          "finish": s.finish, "routes": s.routes} for s in self.seqs]}

    def load_state_dict(self, state: dict, max_version: int | None = None, where: str = "generation") -> None:
        """A checkpoint's state, each field checked first (megarl/rollout/partial_state.py): tokens
        sampled by weight versions up to `max_version` (the saved step's); `where` names it in a refusal."""
        check_generation(state, self.prompts, self.n, self.sampling.max_tokens, max_version, where)
        self.chunks_done = int(state["chunks_done"])
        self.seqs = [_Seq(list(s["prompt"]), list(s["tokens"]), list(s["log_probs"]), list(s["versions"]),
                          s["finish"], s["routes"]) for s in state["seqs"]]

    def completions(self, prompts: list[int] | None = None) -> tuple[list[list[Completion]], list[list[int]]]:
        """Per prompt (all, or those listed), its n completions; per completion, a version per token."""
        chosen = range(len(self.prompts)) if prompts is None else prompts
        seqs = [s for i in chosen for s in self.seqs[i * self.n:(i + 1) * self.n]]
        if any(s.finish is None for s in seqs):
            raise RuntimeError("completions() of an unfinished prompt group; call step() until it is done")
        groups = [[_done(s) for s in seqs[i:i + self.n]] for i in range(0, len(seqs), self.n)]
        return groups, [s.versions for s in seqs]


def _done(s: _Seq) -> Completion:
    assert s.finish is not None
    return Completion(s.tokens, s.log_probs, s.finish, routed_experts=s.routes)


def step_together(gens: list[ChunkedGeneration], engine, version: int, pause=None, join=None) -> int:
    """One step of several generations in shared engine calls: a stream's next batch starts while
    the batch before it finishes its long responses, and both fill the engine's rows.

    `pause(left)`, on a pausable engine, is asked at every chunk boundary with, per generation
    and prompt, how many of its samples are unfinished; True stops the step there. The first
    generation leads: its chunk size, sampling and chunk index (for the seed) are the calls'.
    On a pausable engine every unfinished sequence goes in one call (`_one_call`), so a new
    batch's prompts run beside the long responses of the one before. Elsewhere each call is one
    chunk: a generation at its first chunk gets n samples per prompt (engines share the prompt's
    prefill across them), and every other unfinished sequence is an n=1 request of its prompt
    plus its response so far, those with the same remaining budget in one call.

    `join()`, on an engine whose pausable call takes `join`, is asked after every `pause` that
    lets the call go on: the generations it returns (new, at their first chunk, each a batch's
    prompts that the engine's `fits_call` accepts) join the running call and `gens`, their
    samples drawn beside the ones in flight, no call ended."""
    live = [(i, g, s) for i, g in enumerate(gens) for s in g.seqs if s.finish is None]
    if not live:
        return 0
    lead = gens[0]
    sp, chunk = lead.sampling, lead.chunk
    budget = sp.max_tokens
    pausable = pause is not None and hasattr(engine, "generate_pausable")
    joins = pausable and join is not None and "join" in inspect.signature(engine.generate_pausable).parameters
    paused = [False]
    applied: set[tuple[int, int]] = set()       # (call prompt, sample) extended as it finished
    streamed = [0]                               # tokens of those

    def call(members, prompts, params, budgets=None, rooms=None, **kwargs):
        """members[i]: the (generation index, prompt index, sequences) that call prompt i stands
        for, rooms[i] each sequence's tokens left before the call (read on a pausable engine only)."""
        if not pausable:
            return engine.generate(prompts, params)
        if "finished" in inspect.signature(engine.generate_pausable).parameters:
            # each sample joins its sequence as it finishes, so a pause() can hand its group over
            # while the call goes on
            def finished(i: int, j: int, c: Completion) -> None:
                g, _, seqs = members[i]
                streamed[0] += gens[g]._extend(seqs[j], c, version, rooms[i][j])
                applied.add((i, j))
            kwargs["finished"] = finished
        # unfinished samples outside this call, per generation and prompt: fixed while it runs
        inside = {id(seq) for *_, seqs in members for seq in seqs}
        outside = [[sum(s.finish is None and id(s) not in inside for s in g.seqs[j:j + g.n])
                    for j in range(0, len(g.seqs), g.n)] for g in gens]
        if joins:
            def joined():
                new, more, counts = join(), [], []
                for g in new:                    # its prompts join as call prompts len(members)...
                    gens.append(g)
                    outside.append([0] * len(g.prompts))
                    for j, prompt in enumerate(g.prompts):
                        members.append((len(gens) - 1, j, g.seqs[j * g.n:(j + 1) * g.n]))
                        rooms.append([budget] * g.n)
                        more.append(prompt)
                        counts.append(g.n)
                return (more, counts) if more else None
            kwargs["join"] = joined

        def ask(unfinished: dict[int, int]) -> bool:
            if not paused[0]:
                left = [list(o) for o in outside]
                for i, n_left in unfinished.items():
                    g, j, _ = members[i]
                    left[g][j] += n_left
                paused[0] = bool(pause(left))
            return paused[0]
        return engine.generate_pausable(prompts, params, ask, chunk, budgets, **kwargs)

    if len(gens) == 1 and lead.chunks_done == 0:
        n = lead.n
        seed = None if sp.seed is None else step_seed(sp.seed, 0)
        members = [(0, i, lead.seqs[i * n:(i + 1) * n]) for i in range(len(lead.prompts))]
        cap = budget if pausable else min(chunk, budget)
        rooms = [[cap] * n for _ in members]
        out = call(members, lead.prompts, sp.with_(max_tokens=cap, seed=seed), rooms=rooms)
        for g in gens:                           # the lead and any generation that joined its call
            g.chunks_done += 1
        if not pausable:
            return lead._extend_all(out, version, cap)
        return streamed[0] + _apply(gens, members, out, rooms, version, applied)
    if pausable:
        return streamed[0] + _one_call(gens, version, call, getattr(engine, "continues_responses", False), applied,
                                       joins)
    # one chunk each; sequences with the same remaining budget share a call (usually one call), and
    # a generation at its first chunk beside others has a call of its own, n samples per prompt
    by_len: dict[int, list[tuple[int, ChunkedGeneration, _Seq]]] = {}
    for i, g, s in live:
        if g.chunks_done:
            by_len.setdefault(min(chunk, budget - len(s.tokens)), []).append((i, g, s))
    added, k = 0, 0
    for k, (cap, items) in enumerate(sorted(by_len.items())):
        seed = None if sp.seed is None else step_seed(sp.seed, lead.chunks_done, stream=k)
        out = call([], [s.prompt + s.tokens for _, _, s in items],
                   sp.with_(n=1, max_tokens=cap, seed=seed))
        added += sum(g._extend(s, group[0], version, cap) for (_, g, s), group in zip(items, out))
    for g in gens:
        if not g.chunks_done:
            k += 1
            seed = None if sp.seed is None else step_seed(sp.seed, lead.chunks_done, stream=k)
            cap = min(chunk, budget)
            added += g._extend_all(call([], g.prompts, sp.with_(n=g.n, max_tokens=cap, seed=seed)), version, cap)
    for g in gens:
        g.chunks_done += 1
    return added


def _apply(gens: list[ChunkedGeneration], members, out, rooms, version: int, applied: set) -> int:
    """A pausable call's completions onto their sequences, but those `applied` as they finished."""
    return sum(gens[g]._extend(s, c, version, room)
               for i, ((g, _, seqs), group, left) in enumerate(zip(members, out, rooms))
               for j, (s, c, room) in enumerate(zip(seqs, group, left)) if (i, j) not in applied)


def _one_call(gens: list[ChunkedGeneration], version: int, call, prefixed: bool, applied: set,
              joins: bool = False) -> int:
    """Every unfinished sequence of `gens` in one pausable call. A generation at its first chunk
    comes in as its prompts with n samples each (one prefill per prompt, not per sample). On an
    engine that continues responses (`prefixes`), the unfinished samples of one prompt come in
    as that prompt with their responses so far (its prefill once, their tokens into their rows);
    elsewhere each is a request of its own, prompt + response so far as its prompt, with the
    budget it has left."""
    lead = gens[0]
    sp, budget = lead.sampling, lead.sampling.max_tokens
    members: list[tuple[int, int, list[_Seq]]] = []
    prompts, caps, samples, prefixes = [], [], [], []
    for i, g in enumerate(gens):
        for j, prompt in enumerate(g.prompts):
            seqs = [s for s in g.seqs[j * g.n:(j + 1) * g.n] if s.finish is None]
            if g.chunks_done == 0 or (prefixed and seqs):
                members.append((i, j, seqs))
                prompts.append(prompt)
                caps.append(budget)
                samples.append(len(seqs))
                prefixes.append([s.tokens for s in seqs])
                continue
            for s in seqs:
                members.append((i, j, [s]))
                prompts.append(s.prompt + s.tokens)
                caps.append(budget - len(s.tokens))
                samples.append(1)
                prefixes.append([[]])
    seed = None if sp.seed is None else step_seed(sp.seed, lead.chunks_done, stream=0)
    # a call that a new batch may join keeps n samples per prompt wide and the whole budget
    params = sp.with_(n=sp.n if joins else max(samples), max_tokens=budget if joins else max(caps), seed=seed)
    left = [[budget - len(s.tokens) for s in seqs] for *_, seqs in members]   # before the call extends them
    kwargs: dict = {}
    if min(samples) < params.n:
        kwargs["samples"] = samples
    if any(r for p in prefixes for r in p):
        kwargs["prefixes"] = prefixes
    out = call(members, prompts, params, caps, left, **kwargs)
    added = _apply(gens, members, out, left, version, applied)
    for g in gens:
        g.chunks_done += 1
    return added
