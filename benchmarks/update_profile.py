"""Where megarl's update step spends its time, phase by phase, at TP1 and TP2 on CPU.

    python benchmarks/update_profile.py                         # 0.4M and 18M Qwen2, TP1 and TP2
    python benchmarks/update_profile.py --sizes 0.4M --tp 1     # one cell
    python benchmarks/update_profile.py --against /tmp/base     # the same, next to another checkout
    python benchmarks/update_profile.py --smoke                 # CI: tiny, one repeat (runs, not speed)

The work is the quickstart's GRPO update (configs/quickstart.yaml): 256 samples of the addition
task (prompts of 4-6 tokens, responses of 2-4, R=8), mini-batches of 128 (two optimizer steps),
micro-batches of 32, packed rows, fp32, the real actor loss (clip-higher 0.28, no KL). Models:
the quickstart's 0.4M Qwen2 (hidden 128, 2 layers) and an 18M one (hidden 512, 6 layers).

Each rank times ActorWorker.update_policy whole, and inside it the pieces below, by wrapping the
functions that do them (explicit timers: wall time, and the process's CPU time, which other
jobs on the cores barely move; a wrapped call's time excludes the wrapped calls inside it, so
the rows add up to the total). Collectives (torch.distributed calls from any
code) are counted with their bytes and timed on their own row. Medians over `--repeats` after
`--warmup` steps, rank 0's. With `--against DIR` each cell runs twice, alternating: once with the
megarl package of DIR (e.g. `git worktree add /tmp/base <commit>`), once with this checkout's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--code" in sys.argv:   # run against another checkout's megarl (--against spawns this)
    sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1])
else:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

SIZES = {
    "0.4M": dict(vocab_size=19, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "18M": dict(vocab_size=19, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64),
    "smoke": dict(vocab_size=19, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
}
SMOKE = dict(sizes="smoke", tp="2", repeats=1, warmup=0, batch=16, mini=8, micro=4)

# Rows of the table, in order; each is where a wrapped function's own time goes.
PHASES = [
    ("data prep", "check_batch, plan, columns, share (DataProto slicing), micro_inputs, split/shuffle"),
    ("zero grad buffers", "DDP zero_grad_buffer before each mini-batch"),
    ("model forward", "GPTModel forward + megatron's forward_step (schedule bookkeeping)"),
    ("lean head fwd", "linear_log_probs forward (LM head + log-prob, chunked)"),
    ("loss fn", "the actor loss and its metrics"),
    ("loss host syncs", "_last_stage: float() of each metric and the loss"),
    ("backward", "autograd through the model (megatron's backward_step)"),
    ("lean head bwd", "linear_log_probs backward (head recompute + grads)"),
    ("schedule other", "get_forward_backward_func's own work"),
    ("finalize grads", "finalize_model_grads (DP/TP grad all-reduces)"),
    ("bad-loss check", "Update.step: the all-reduce of a not-finite flag"),
    ("grad norm", "optimizer get_grad_norm (+ its all-reduces)"),
    ("clip", "grad clipping"),
    ("optimizer step", "AdamW step"),
    ("optimizer other", "prepare_grads, zero_grad, optimizer_step's own work"),
    ("metric reduce", "Update.mean_metrics (gathers over DP / PP)"),
    ("collectives", "time inside torch.distributed calls (all phases)"),
    ("other", "update_policy minus the rows above"),
]
# After "total": the forward-only log-prob pass on the same batch (compute_log_prob), and at TP2
# the step's collectives replayed with both ranks ready (gloo_alone).


class Timers:
    """Exclusive time per phase: a wrapped call's time minus that of wrapped calls inside it."""

    def __init__(self):
        self.own: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)     # process CPU seconds (all its threads)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.stack: list[list[float]] = []

    def reset(self):
        self.own.clear(), self.cpu.clear(), self.calls.clear(), self.bytes.clear()

    def wrap(self, name, fn, count_bytes=False):
        timers = self

        @functools.wraps(fn)
        def run(*args, **kwargs):
            timers.stack.append([0.0, 0.0])
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, dc = time.perf_counter() - t, time.process_time() - c
                inner = timers.stack.pop()
                timers.own[name] += dt - inner[0]
                timers.cpu[name] += dc - inner[1]
                timers.calls[name] += 1
                if count_bytes:
                    timers.bytes[name] += _nbytes(args[:2])
                if timers.stack:
                    timers.stack[-1][0] += dt
                    timers.stack[-1][1] += dc
        return run

    def patch(self, owner, attr, name, static=False, **kw):
        fn = getattr(owner, attr, None)
        if fn is None:      # an older or newer checkout without this function: its time goes to "other"
            return
        wrapped = self.wrap(name, fn, **kw)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


def _nbytes(args) -> int:
    """The whole tensor a collective works on (an all-gather's output, a reduce-scatter's input)."""
    sizes = [0]
    for a in args:
        if torch.is_tensor(a):
            sizes.append(a.numel() * a.element_size())
        elif isinstance(a, (list, tuple)):
            sizes.append(sum(t.numel() * t.element_size() for t in a if torch.is_tensor(t)))
    return max(sizes)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_gather_object", "broadcast_object_list", "barrier", "send", "recv", "isend", "irecv",
               "_all_gather_base", "_reduce_scatter_base", "all_to_all_single")


def instrument(timers: Timers) -> None:
    """Wrap the functions whose time the table reports (before the worker is built)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel import schedules

    import megarl.workers.outputs as outputs
    from megarl.workers import batching, logprob, optim, schedule, update
    from megarl.workers.engine import MegatronEngine
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import mappings
    for name in COLLECTIVES:
        timers.patch(dist, name, f"dist.{name}", count_bytes=True)
    for module in (mappings, param_and_grad_buffer):   # megatron binds these two at import
        timers.patch(module, "dist_all_gather_func", "dist.all_gather_into_tensor", count_bytes=True)
        timers.patch(module, "dist_reduce_scatter_func", "dist.reduce_scatter_tensor", count_bytes=True)
    timers.patch(schedule, "get_forward_backward_func", "schedule other")
    timers.patch(schedules, "forward_step", "model forward")
    timers.patch(schedules, "backward_step", "backward")
    timers.patch(schedule, "_last_stage", "loss host syncs")
    timers.patch(outputs, "linear_log_probs", "lean head fwd")
    timers.patch(logprob._LinearLogProbs, "backward", "lean head bwd", static=True)
    timers.patch(DistributedDataParallel, "zero_grad_buffer", "zero grad buffers")
    timers.patch(update, "finalize_model_grads", "finalize grads")
    timers.patch(update.Update, "step", "bad-loss check")
    timers.patch(update, "optimizer_step", "optimizer other")
    for owner in (optim.CPUAdamW, getattr(optim, "FastAdamW", None)):
        if owner is not None:
            timers.patch(owner, "get_grad_norm", "grad norm")
            timers.patch(owner, "clip", "clip")
            timers.patch(owner, "step_with_ready_grads", "optimizer step")
    timers.patch(update.Update, "mean_metrics", "metric reduce")
    for owner, attr in ((batching, "check_batch"), (schedule.batching, "plan"), (schedule.Schedule, "columns"),
                        (schedule.Schedule, "share"), (schedule.packing, "micro_inputs"),
                        (update.Update, "_order"), (MegatronEngine, "_count")):
        timers.patch(owner, attr, "data prep")


def make_batch(vocab: int, n: int, seed: int = 0):
    """`n` addition-shaped samples: prompts of 4-6 tokens, responses of 2-4 (R=8), with
    advantages and old log-probs as a GRPO step carries them."""
    from megarl.models.tiny import token_rows
    from megarl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(4, 7, (n,), generator=g)
    rlen = torch.randint(2, 5, (n,), generator=g)
    rows = token_rows(plen, rlen, 8, vocab, g)
    rows["advantages"] = torch.randn(n, 1, generator=g).expand(n, 8).contiguous() * rows["response_mask"]
    rows["old_log_probs"] = -torch.rand(n, 8, generator=g) * rows["response_mask"]
    return DataProto.from_dict(rows)


def rank_main(rank, world, path, a):
    import torch.distributed as dist

    from megarl.algos.loss_fn import make_actor_loss_fn
    from megarl.experiment import load_config
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    torch.set_num_threads(a.threads)
    timers = Timers()
    instrument(timers)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}", f"trainer.n_gpus_per_node={world}",
                             f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={world}",
                             f"actor_rollout_ref.actor.ppo_mini_batch_size={a.mini // 8}",
                             "actor_rollout_ref.rollout.n=8", f"data.train_batch_size={a.batch // 8}",
                             f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.micro}",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.optim.lr=1e-4",
                             "data.max_prompt_length=16", "data.max_response_length=8", "trainer.device=cpu",
                             "algorithm.adv_estimator=grpo"]
                      + ([f"actor_rollout_ref.actor.megatron.sequence_parallel={a.sp}"] if world > 1 else []))
    state.init_distributed()   # the rank set-up: the engine starts no process group
    actor = ActorWorker.from_config(cfg.resolved(1))
    loss = timers.wrap("loss fn", make_actor_loss_fn(cfg))
    data = make_batch(a.shape["vocab_size"], a.batch)
    update = timers.wrap("other", actor.update_policy)
    steps = []
    for i in range(a.warmup + a.repeats):
        dist.barrier()
        timers.reset()
        t, c = time.perf_counter(), time.process_time()
        update(data, loss)
        total, total_cpu = time.perf_counter() - t, time.process_time() - c
        if i >= a.warmup:
            coll = {k: v for k, v in timers.own.items() if k.startswith("dist.")}
            row = {k: v for k, v in timers.own.items() if not k.startswith("dist.")}
            row["collectives"] = sum(coll.values())
            row["total"] = total
            cpu = {k: v for k, v in timers.cpu.items() if not k.startswith("dist.")}
            cpu["collectives"] = sum(v for k, v in timers.cpu.items() if k.startswith("dist."))
            cpu["total"] = total_cpu
            row.update({"cpu " + k: v for k, v in cpu.items()})
            steps.append({"phases": row, "calls": {k: timers.calls[k] for k in coll},
                          "bytes": {k: timers.bytes[k] for k in coll}, "coll_s": coll})
    fwd = []     # the forward-only log-prob pass over the same batch: what "update / forward" compares with
    for i in range(a.warmup + a.repeats):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        actor.compute_log_prob(data)
        fwd.append((time.perf_counter() - t, time.process_time() - c))
    gloo = gloo_alone(steps[-1], world) if world > 1 else {}
    fwd = fwd[a.warmup:]
    return steps, actor.engine.spec.num_parameters(), [statistics.median(f[j] for f in fwd) for j in (0, 1)], gloo


def gloo_alone(step: dict, world: int) -> dict[str, float]:
    """Seconds the step's collectives take when both ranks arrive together: each kind replayed
    as many times, at its mean size, back to back (gloo's own cost; the rest of the collectives'
    time in the step is one rank waiting for the other)."""
    import torch.distributed as dist
    out = {}
    for name, calls in step["calls"].items():
        kind = name[5:]
        if kind not in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor") or not calls:
            continue
        numel = max(world, step["bytes"][name] // 4 // calls // world * world)
        full = torch.zeros(numel)
        part = torch.zeros(numel // world)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            if kind == "all_reduce":
                dist.all_reduce(full)
            elif kind == "all_gather_into_tensor":
                dist.all_gather_into_tensor(full, part)
            else:
                dist.reduce_scatter_tensor(part, full)
        out[kind] = time.perf_counter() - t
    return out


def run_cell(size: str, tp: int, a) -> dict:
    from megarl.models.tiny import make_tiny_hf
    from megarl.parallel.local_ranks import run_local
    a.shape = SIZES[size]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_hf(os.path.join(tmp, "model"), "qwen2", tokenizer=True, **a.shape)
        ranks = run_local(tp, rank_main, (path, a))
    steps, params, fwd, gloo = ranks[0]
    phases = sorted({k for s in steps for k in s["phases"]})
    med = {k: statistics.median(s["phases"].get(k, 0.0) for s in steps) for k in phases}
    med["forward-only pass"], med["cpu forward-only pass"] = fwd
    med["gloo alone"] = sum(gloo.values())
    coll = sorted({k for s in steps for k in s["calls"]})
    return {"size": size, "tp": tp, "params": params, "median": med, "peak_mb": ranks.peak_mb,
            "collectives": {k: (statistics.median(s["calls"].get(k, 0) for s in steps),
                                statistics.median(s["bytes"].get(k, 0) for s in steps),
                                statistics.median(s["coll_s"].get(k, 0.0) for s in steps)) for k in coll}}


def print_cells(cells: list[dict], labels: list[str]) -> None:
    """One table per (size, TP): a column per arm (ms, medians), and the collectives."""
    by = defaultdict(dict)
    for cell, label in zip(cells, labels):
        by[(cell["size"], cell["tp"])][label] = cell
    arms = list(dict.fromkeys(labels))
    for (size, tp), got in by.items():
        params = next(iter(got.values()))["params"]
        print(f"\n## {size} Qwen2 ({params / 1e6:.2f}M parameters), TP{tp}: ms per update_policy "
              f"({ARGS.batch // ARGS.mini} optimizer steps), median of {ARGS.repeats} after {ARGS.warmup} warm-up")
        two = len(arms) == 2
        print(f"{'phase':<20}" + "".join(f"{arm:>10}" for arm in arms) + ("   ratio" if two else "") +
              "".join(f"{'cpu ' + arm:>12}" for arm in arms) + ("   ratio" if two else ""))
        for name, _ in PHASES + [("total", ""), ("forward-only pass", ""), ("gloo alone", "")]:
            line = f"{name:<20}"
            for key, width in ((name, 10), ("cpu " + name, 12)):
                vals = [got[arm]["median"].get(key, 0.0) * 1e3 if arm in got else float("nan") for arm in arms]
                line += "".join(f"{v:{width}.1f}" for v in vals)
                line += (f"   {vals[1] / vals[0]:.2f}x" if vals[0] > 0.05 else "       ") if two else ""
            print(line.rstrip())
        for key in ("", "cpu "):
            print(f"{key + 'total / forward':<20}" + "".join(
                f"{got[arm]['median'][key + 'total'] / got[arm]['median'][key + 'forward-only pass']:9.2f}x"
                if arm in got else "" for arm in arms))
        for arm in arms:
            if arm in got:
                print(f"  peak resident MiB per rank ({arm}): " +
                      ", ".join(f"rank {r} {mb:.0f}" for r, mb in enumerate(got[arm]["peak_mb"])))
            coll = got[arm]["collectives"] if arm in got else {}
            if coll:
                print(f"  collectives ({arm}): " + ", ".join(
                    f"{k[5:]} {int(c)}x {b / 1024:.0f} KiB {s * 1e3:.1f} ms" for k, (c, b, s) in coll.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.4M,18M")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--mini", type=int, default=128)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank (1: steady when other jobs share the cores; TP2 then uses 2 cores)")
    ap.add_argument("--sp", choices=("true", "false"), default="true",
                    help="megatron.sequence_parallel at TP2 (verl's default and megarl's: true)")
    ap.add_argument("--against", help="another checkout (its megarl) to time next to this one")
    ap.add_argument("--code", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    a = ap.parse_args()
    if a.smoke:
        vars(a).update(SMOKE)
    global ARGS
    ARGS = a
    cells = [(s, int(t)) for s in a.sizes.split(",") for t in a.tp.split(",")]
    if a.json:      # one arm, spawned by --against
        with open(a.json, "w") as f:
            json.dump([run_cell(s, t, a) for s, t in cells], f)
        return
    print(f"uptime: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (load 1/5/15 min), "
          f"{os.cpu_count()} cores; batch {a.batch}, mini {a.mini}, micro {a.micro}, {a.threads} thread(s) per rank, "
          f"sequence_parallel={a.sp} at TP2")
    if not a.against:
        got = [run_cell(s, t, a) for s, t in cells]
        print_cells(got, ["ms"] * len(got))
        return
    got, labels = [], []
    for s, t in cells:          # alternate the two arms cell by cell (load drifts)
        for label, code in (("before", os.path.abspath(a.against)), ("after", ROOT)):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, os.path.abspath(__file__), "--code", code, "--json", out.name,
                       "--sizes", s, "--tp", str(t), "--repeats", str(a.repeats), "--warmup", str(a.warmup),
                       "--batch", str(a.batch), "--mini", str(a.mini), "--micro", str(a.micro),
                       "--threads", str(a.threads), "--sp", a.sp]
                subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": code})
                got += json.load(open(out.name))
                labels.append(label)
    print_cells(got, labels)
    print(f"uptime after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
