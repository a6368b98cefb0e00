"""The long-tailed task's generation alone, on the built-in engine: what a rollout rank spends per
batch under each schedule partial rollouts and the stream use, without a trainer.

    python benchmarks/async_speedup.py --longtail --long-digits 30 --long-fraction 0.04 --engine-only \
        [--device cuda] [--phases] --out runs/bench/longtail30

Two tables. Batch by batch, the ways alternated: one whole-batch call against chunks (one call
per chunk, or the pausable call paused once). Then the batches one after another, as a rollout
rank meets them: whole-batch calls against the stream's schedule with tail_overlap=0.5 (each
batch starts once half of the one before is done and shares its calls), with the engine's
counters (prompts prefilled, prefill passes, decode steps, CUDA graphs captured) and, with
--phases, the seconds spent in prefill passes, decode steps, reading finished rows back, and
the rest (the calls' set-up and the schedule's own bookkeeping), each timed with the device
synchronised. A warm-up round of each schedule comes first: a CUDA graph is captured once per
decode step shape, and the two schedules' shapes differ.
"""
from __future__ import annotations

import json
import statistics
import time


def engine_only(args) -> None:
    """The rollout rank's cost per batch on the long-tailed task, without a trainer: one whole-batch
    generate call (what one_step does) against the same batch in chunks as partial rollouts run
    them: one call per chunk (each re-submits prompt + response so far: an engine that cannot
    pause) and the built-in engine's pausable call, asked at every chunk boundary and paused once,
    at the second (an update landing mid-batch: one re-submission). The built-in engine, in this
    process, one thread; the run's sampling (T=1, EOS stops), `--batches` batches of the training
    data, median seconds per batch after one warm-up batch. `--device cuda`: the same on a GPU,
    where a decode step costs about the same for few rows as for many (CUDA graphs)."""
    import torch
    from megarl.examples.addition import bootstrap
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.native.engine import NativeEngine
    from megarl.rollout.partial import ChunkedGeneration
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    extra = dict(x.split("=", 1) for x in args.extra)
    kw = "actor_rollout_ref.model.bootstrap_kwargs."
    bootstrap(args.model, **{k[len(kw):]: int(v) if v.isdigit() else float(v)
                             for k, v in extra.items() if k.startswith(kw)})
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(extra["data.train_files"]) as f:
        rows = [json.loads(line) for line in f][:32 * (args.batches + 1)]
    prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids for r in rows]
    engine = NativeEngine.from_pretrained(args.model, device=args.device)
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else
                                     f", {torch.get_num_threads()} thread"))
    sp = SamplingParams(n=8, max_tokens=int(extra["data.max_response_length"]), temperature=1.0, seed=0,
                        eos_token_ids=[tok.eos_token_id])
    print(f"{args.batches} batches of 32 prompts x n=8, response limit {sp.max_tokens}; median seconds per batch "
          "(one warm-up batch first)")
    ways = [(0, False), (4, False), (8, False), (16, False), (4, True)]
    times: dict = {w: [] for w in ways}
    longest: dict = {w: [] for w in ways}
    for b in range(args.batches + 1):             # the ways alternate batch by batch: load drifts hit all
        batch = prompts[32 * b:32 * (b + 1)]
        for chunk, pausable in ways:
            start = time.perf_counter()
            if chunk:
                gen = ChunkedGeneration(batch, sp, chunk)
                asked = iter([False, True])
                while not gen.done:
                    gen.step(engine, 0, (lambda unfinished: next(asked, False)) if pausable else None)
                got = max(len(s.tokens) for s in gen.seqs)
            else:
                got = max(len(c.token_ids) for g in engine.generate(batch, sp) for c in g)
            if b:
                times[chunk, pausable].append(time.perf_counter() - start)
                longest[chunk, pausable].append(got)
    base = statistics.median(times[0, False])
    for (chunk, pausable), got in times.items():
        name = (f"chunks of {chunk}" + (", pausable" if pausable else "")) if chunk else "whole batch"
        print(f"  {name:24s} {statistics.median(got):.3f} s  {statistics.median(got) / base:.2f}x  (longest "
              f"response per batch {' '.join(map(str, longest[chunk, pausable]))})")
    batches = [prompts[32 * b:32 * (b + 1)] for b in range(1, args.batches + 1)]
    print(f"the {args.batches} batches one after another, one warm-up round and three timed, alternated; "
          "median seconds per batch (engine counters of the last round; graphs captured in all timed rounds)")
    per_batch: dict = {"whole-batch calls": [], "next batch in the tail, pausable": []}
    work: dict = {name: {} for name in per_batch}
    captured = dict.fromkeys(per_batch, 0)

    phases: dict = {name: {} for name in per_batch}
    timers = PhaseTimers(args.device) if args.phases else None

    def counted(name: str, run, timed: bool) -> None:
        before = engine_counters(engine)
        if timers:
            timers.reset()
        start = time.perf_counter()
        run()
        if timed:    # a CUDA graph is captured once per step shape: the warm-up round captures most
            per_batch[name].append((time.perf_counter() - start) / len(batches))
            work[name] = {k: v - before[k] for k, v in engine_counters(engine).items()}
            captured[name] += work[name].pop("graphs captured")
            if timers:
                phases[name] = timers.split(time.perf_counter() - start)
    for r in range(4):
        counted("whole-batch calls", lambda: [engine.generate(batch, sp) for batch in batches], r > 0)
        counted("next batch in the tail, pausable", lambda: in_the_tail(engine, batches, sp, 4, 0.5), r > 0)
    base = statistics.median(per_batch["whole-batch calls"])
    for name, got in per_batch.items():
        print(f"  {name:34s} {statistics.median(got):.3f} s  {statistics.median(got) / base:.2f}x  ("
              + ", ".join(f"{k} {v}" for k, v in work[name].items()) + f", graphs captured {captured[name]})")
        if phases[name]:
            print(f"  {'':34s} last round, seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in phases[name].items()))
    if timers:
        timers.close()


def engine_counters(engine) -> dict:
    """What the built-in engine did: calls aside, the work a schedule costs it."""
    s, d = engine.stats, engine.decode.stats
    return {"prompts prefilled": s["prefills"], "prefill passes": s["prefill_batches"],
            "decode steps": s["decode_steps"], "graphs captured": d["captured"]}


def in_the_tail(engine, batches, sp, chunk: int, fraction: float) -> float:
    """Seconds for the stream's engine work on `batches` with tail_overlap=fraction
    (megarl/trainer/stream/worker.py without a trainer: no update lands): a batch starts once at
    most that fraction of the samples of the one in flight are unfinished, and both share the
    engine's calls until the older one is done."""
    from megarl.rollout.partial import ChunkedGeneration, step_together
    pending, gens = list(batches), []
    start = time.perf_counter()
    while pending or gens:
        if not gens:
            gens.append(ChunkedGeneration(pending.pop(0), sp, chunk))

        def pause(left: list[list[int]]) -> bool:
            unfinished = [sum(per_prompt) for per_prompt in left]
            if len(gens) == 1:
                return bool(pending) and unfinished[0] <= fraction * len(gens[0].seqs)
            return unfinished[0] == 0
        step_together(gens, engine, 0, pause)
        gens = [g for g in gens if not g.done]
        if len(gens) == 1 and pending and gens[0].unfinished() <= fraction * len(gens[0].seqs):
            gens.append(ChunkedGeneration(pending.pop(0), sp, chunk))
    return time.perf_counter() - start


class PhaseTimers:
    """Seconds in the built-in engine's prefill passes, decode steps and read-backs (the
    scheduler's _admit, _step and _retire), the device synchronised around each."""
    PHASES = {"_admit": "prefill", "_step": "decode steps", "_retire": "read-back"}

    def __init__(self, device: str):
        import torch
        from megarl.rollout.native.scheduler import Scheduler
        self.cls, self.saved = Scheduler, {}
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.spent: dict = {}
        for name in self.PHASES:
            self.saved[name] = getattr(Scheduler, name)
            setattr(Scheduler, name, self._timed(name, self.saved[name]))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.spent = {}

    def split(self, total: float) -> dict:
        out = {label: self.spent.get(name, 0.0) for name, label in self.PHASES.items()}
        out["the rest"] = total - sum(out.values())
        return out

    def close(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)
