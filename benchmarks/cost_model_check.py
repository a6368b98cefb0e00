"""gpu_check's cost-model section: the engine cost model's terms measured on the GPU it runs on.

    python benchmarks/gpu_check.py                          # runs this section on the GPU
    python benchmarks/gpu_check.py --device cpu --dry-run   # the same code at tiny sizes: plumbing only

The cost model (megarl/rollout/cost_model.py, `actor_rollout_ref.rollout.cost_model.*`) charges a
decode step `decode_s + decode_row_s * rows` and a call's prefill `prefill_token_s` per prompt token;
its defaults are the built-in engine's on one H100 (docs/measurements.md, the long-tailed task).
This section builds the built-in engine (NativeEngine) on that task's model shape (the addition
model, random weights: no training needed, every row runs to max_tokens) and measures, after a
warm-up call per point (CUDA graphs captured there, not in the timed calls), the median of
`repeats` calls, the device synchronised around each:
- a decode step against rows: prompts x n=8 samples (the task's n), a call of `steps` + 1 tokens
  against the same call of 1 token (prefill only), the two alternated, the difference over the
  engine's own count of decode steps (`stats["decode_steps"]`);
- a prefill call against its prompt tokens: prompts of one length, max_tokens=1 (no decode step),
  one prefill pass each (the engine's `prefill_batches` count is reported beside it).
It fits a + b * rows and d + c * tokens (least squares), puts each point beside the model's
prediction with the defaults at scale 1 (their ratio), and says in one line whether the defaults
are within 2x of this device at every point.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

LIMIT = 2.0          # the defaults agree with a device where every point is within this factor

FULL = dict(rows=(1, 8, 32, 128, 256), steps=32, decode_prompt=8, prefill_prompt=32,
            prefill_prompts=(2, 8, 32, 128, 256), repeats=7)
DRY = dict(rows=(1, 4, 16), steps=6, decode_prompt=8, prefill_prompt=8, prefill_prompts=(2, 8, 32), repeats=5)
DRY_LABEL = "dry run on CPU: plumbing only, these are not GPU figures"


def fit(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) != len(y) or len(set(x.tolist())) < 2:
        raise ValueError(f"fit needs points at two x values or more, got x={x.tolist()} y={y.tolist()}")
    (intercept, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    return float(intercept), float(slope)


def _ratio(measured: float, model: float) -> float:
    return measured / model if model > 0 else float("inf")


def judge(decode: list[dict], prefill: list[dict], cfg=None) -> dict:
    """Each measured point beside the cost model's prediction (`cfg`, default CostModelConfig() at
    scale 1), the fitted terms beside the model's, and whether every point is within LIMIT.
    `decode`: [{"rows", "step_s"}]; `prefill`: [{"tokens", "call_s"}]."""
    from megarl.rollout.config import CostModelConfig
    cfg = cfg or CostModelConfig()
    dec = [{**p, "model_s": cfg.scale * (cfg.decode_s + cfg.decode_row_s * p["rows"])} for p in decode]
    pre = [{**p, "model_s": cfg.scale * cfg.prefill_token_s * p["tokens"]} for p in prefill]
    for p in dec:
        p["ratio"] = _ratio(p["step_s"], p["model_s"])
    for p in pre:
        p["ratio"] = _ratio(p["call_s"], p["model_s"])
    a, b = fit([p["rows"] for p in dec], [p["step_s"] for p in dec])
    d, c = fit([p["tokens"] for p in pre], [p["call_s"] for p in pre])
    off = [f"decode {p['rows']} rows {p['ratio']:.2f}x" for p in dec if not 1 / LIMIT <= p["ratio"] <= LIMIT]
    off += [f"prefill {p['tokens']} tokens {p['ratio']:.2f}x" for p in pre if not 1 / LIMIT <= p["ratio"] <= LIMIT]
    verdict = (f"the defaults are within {LIMIT:g}x of this device at every point" if not off else
               f"the defaults are NOT within {LIMIT:g}x of this device (measured / model: {', '.join(off)}): "
               "set actor_rollout_ref.rollout.cost_model.* from the fit to model this device")
    return {"decode": dec, "prefill": pre, "within_limit": not off, "limit": LIMIT, "verdict": verdict,
            "fit": {"decode_s": a, "decode_row_s": b, "prefill_pass_s": d, "prefill_token_s": c},
            "defaults": {"decode_s": cfg.decode_s, "decode_row_s": cfg.decode_row_s,
                         "prefill_token_s": cfg.prefill_token_s, "scale": cfg.scale}}


def _model_dir(out: str) -> str:
    """The long-tailed task's model shape (megarl/examples/addition/model.py), random weights,
    positions for the longest call here."""
    from megarl.examples.addition.model import build_model, build_tokenizer
    path = os.path.join(out, "cost_model_check_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        tok = build_tokenizer()
        build_model(tok, max_position_embeddings=256).save_pretrained(path)
        tok.save_pretrained(path)
    return path


class Timer:
    """Calls of the engine, timed with the device synchronised, with its counters per call."""

    def __init__(self, engine, device: str):
        self.engine, self.cuda = engine, device.startswith("cuda")

    def __call__(self, prompts: list[list[int]], sp) -> dict:
        import torch
        e = self.engine
        before = (e.stats["decode_steps"], e.stats["prefill_batches"], e.decode.stats.get("captured", 0))
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        e.generate(prompts, sp)
        if self.cuda:
            torch.cuda.synchronize()
        s = time.perf_counter() - t
        return {"s": s, "decode_steps": e.stats["decode_steps"] - before[0],
                "passes": e.stats["prefill_batches"] - before[1],
                "captured": e.decode.stats.get("captured", 0) - before[2]}


def _calls(timer: Timer, prompts, sps: list, repeats: int) -> list[list[dict]]:
    """`repeats` timed calls per sampling in `sps`, alternated (a load drift hits each alike),
    after one warm-up call each: the CUDA graphs of these shapes are captured there."""
    for sp in sps:
        timer(prompts, sp)
    timed: list[list[dict]] = [[] for _ in sps]
    for _ in range(repeats):
        for got, sp in zip(timed, sps):
            got.append(timer(prompts, sp))
    return timed


def measure(engine, device: str, sizes: dict, vocab: int) -> tuple[list[dict], list[dict]]:
    """(decode points, prefill points) as `judge` takes them, with the calls' counters."""
    import torch
    from megarl.rollout.base import SamplingParams
    g = torch.Generator().manual_seed(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (count, length), generator=g).tolist()  # no pad/eos/unk ids
    # A stop id the model cannot sample (== vocab): the engine reads its rows' stops back every
    # step, as with EOS in a training run, while every row still runs to max_tokens.
    stop = dict(stop_token_ids=[vocab], temperature=1.0, seed=0)
    timer, steps, rep = Timer(engine, device), sizes["steps"], sizes["repeats"]
    big = max(max(sizes["rows"]), max(sizes["prefill_prompts"]))
    longest = max(sizes["decode_prompt"], sizes["prefill_prompt"])
    # the largest call first: the KV cache and row state are allocated once, at their final size,
    # so no later call reallocates them (which would drop every captured graph)
    timer(prompts(big, longest), SamplingParams(n=1, max_tokens=steps + 1, **stop))
    decode = []
    for rows in sizes["rows"]:
        n = min(rows, 8)
        batch = prompts(rows // n, sizes["decode_prompt"])
        long, short = _calls(timer, batch, [SamplingParams(n=n, max_tokens=steps + 1, **stop),
                                            SamplingParams(n=n, max_tokens=1, **stop)], rep)
        dsteps = long[0]["decode_steps"] - short[0]["decode_steps"]
        step_s = (statistics.median(c["s"] for c in long) - statistics.median(c["s"] for c in short)) / dsteps
        decode.append({"rows": rows, "step_s": step_s, "decode_steps": dsteps, "repeats": rep,
                       "captured_in_timed": sum(c["captured"] for c in long + short)})
    prefill = []
    for count in sizes["prefill_prompts"]:
        calls, = _calls(timer, prompts(count, sizes["prefill_prompt"]), [SamplingParams(n=1, max_tokens=1, **stop)],
                        rep)
        prefill.append({"tokens": count * sizes["prefill_prompt"], "prompts": count,
                        "call_s": statistics.median(c["s"] for c in calls), "passes": calls[0]["passes"],
                        "repeats": rep, "captured_in_timed": sum(c["captured"] for c in calls)})
    return decode, prefill


def run(device: str, dry: bool, out: str) -> dict:
    import torch
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.native.engine import NativeEngine
    sizes = DRY if dry else FULL
    path = _model_dir(out)
    engine = NativeEngine.from_pretrained(path, device=device)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    label = (f"measured on {name}" if not dry else DRY_LABEL if name == "cpu" else
             f"dry run on {name}: tiny sizes, plumbing only")
    print(f"  cost model check: {label} (built-in engine, {engine.dtype}, the long-tailed task's model shape)",
          flush=True)
    threads = torch.get_num_threads()
    if name == "cpu":   # one thread, as the CPU benchmarks run the engine: on a shared machine a
        torch.set_num_threads(1)   # second thread waiting for a busy core multiplies a small step's time
    try:
        decode, prefill = measure(engine, device, sizes, read_hf_config(path)["vocab_size"])
    finally:
        torch.set_num_threads(threads)
    result = judge(decode, prefill)
    result.update(device=device, device_name=name, dry=dry, label=label, dtype=str(engine.dtype),
                  sizes={k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()})
    print("\n".join(f"  {what}: {figures}" for what, figures in table(result)), flush=True)
    return result


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def table(r: dict) -> list[tuple[str, str]]:
    """The section as (what, figures) pairs: printed while it runs, and gpu_check.md's rows."""
    f, d = r["fit"], r["defaults"]
    out = [(f"cost model vs this device ({r['label']})", r["verdict"]),
           ("cost model: decode step vs rows", ", ".join(
               f"{p['rows']} rows {_ms(p['step_s'])} (model {_ms(p['model_s'])}, {p['ratio']:.2f}x)"
               for p in r["decode"])),
           ("cost model: prefill call vs tokens", ", ".join(
               f"{p['tokens']} tokens {_ms(p['call_s'])} (model {_ms(p['model_s'])}, {p['ratio']:.2f}x, "
               f"{p['passes']} pass)" for p in r["prefill"])),
           ("cost model: fitted terms vs defaults",
            f"decode {_ms(f['decode_s'])} + {f['decode_row_s'] * 1e6:.3g} us x rows, prefill "
            f"{_ms(f['prefill_pass_s'])} per pass + {f['prefill_token_s'] * 1e6:.3g} us x tokens; defaults: "
            f"decode {_ms(d['decode_s'])} + {d['decode_row_s'] * 1e6:.3g} us x rows, prefill "
            f"{d['prefill_token_s'] * 1e6:.3g} us x tokens")]
    captured = sum(p["captured_in_timed"] for p in r["decode"] + r["prefill"])
    if captured:
        out.append(("cost model: warning", f"{captured} CUDA graphs captured inside timed calls: "
                                           "those points include capture time"))
    return out


def rows(r: dict) -> list[str]:
    """gpu_check.md's lines for this section."""
    return [f"| {what} | {figures} |" for what, figures in table(r)]
