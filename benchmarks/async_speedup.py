"""Synchronous colocated vs disaggregated one-step off-policy vs partial rollout, on the
quickstart's addition task: same model, steps, seed and batch for the three.

    python benchmarks/async_speedup.py [--steps 30] [--test-freq 10] [--rounds 2] [--out runs/bench/async]
    python benchmarks/async_speedup.py --model-only --gen 1.2 --train 0.9 --sync 0.05   # the 64-GPU model
    python benchmarks/async_speedup.py --smoke --out /tmp/async_smoke   # CI: 2 modes x 3 steps, a 20-step model
    python benchmarks/async_speedup.py --longtail --steps 16 --test-freq 16 --rounds 1 --out runs/bench/longtail
    python benchmarks/async_speedup.py --seeds 1 2 3 --steps 100 --test-freq 50 --out runs/bench/seeds
    python benchmarks/async_speedup.py --longtail --engine-only --out runs/bench/longtail   # generation alone
    python benchmarks/async_speedup.py --paced --steps 12 --test-freq 4 --out runs/bench/paced  # the GPU regime
                                                                 # (benchmarks/async_engine.py)

Each mode is one `python -m megarl.train` run on the same 2 processes (one per core):
    sync      rollout.placement=colocated, actor TP 2 (the quickstart's layout); each step
              generates, then trains
    sync_dp2  the same with actor TP 1 x DP 2 (the trainer layout the async modes use, per rank),
              to tell the overlap's gain from the layout's
    one_step  placement=disaggregated: rank 0 trains (TP 1), rank 1 generates batch k+1 meanwhile
    partial   the same with async_training.partial_rollout=true (chunks of 4 tokens)
    stream_k2, stream_k4   partial, generating up to 2 (4) batches ahead: max_staleness=2 (4)
    stream_k2_tail         stream_k2 with tail_overlap=0.5: the next batch starts in the tail of
                           the one in flight
    stream_k2_groups       stream_k2_tail with handoff=finished_groups: a step takes the first
                           finished groups, the tail's last ones go to a later step
    stream_k4_decoupled    stream_k4 trained with the decoupled PPO loss (--seeds: its accuracy question)
    stream_k2_paced, stream_k4_paced   stream_k2/4 with tail_overlap=0.5, handoff=finished_groups and
                           kv_after_update=keep (updates land inside the engine's call)
--paced runs sync, one_step and both paced streams on the 30-digit long-tailed task under the engine
cost model (megarl/rollout/cost_model.py: a decode step and a prefill take what the built-in engine's
take on an H100, times --pace-scale), so generation is the long phase as on a GPU node; every figure
it prints is labelled as taken under the model, and the model is printed beside them, with the
model's seconds per step by kind (decode, new prompts' prefill, continued responses' prefill,
regenerations) for the modes with a rollout side of their own.
Dynamic sampling is off in all three (the async loop refuses it). Prints steps/hour (median
step time after warm-up), held-out accuracy at equal steps, staleness and the phase timings,
and draws accuracy against wall time (accuracy_vs_time.png in --out).

Figures, with their dates, machines and commands: docs/measurements.md. The ratio depends on the
machine's load: the colocated mode serialises its phases on shared cores, so a loaded machine
overstates the speed-up a quiet one gives.

The pipeline model (`expected_speedup`) is a small model, not a claim: colocated, a step costs
gen + train + sync on all G devices; disaggregated, R devices generate while G - R train, so a
step costs max(gen', train') + sync with gen' and train' rescaled to their device counts, gen'
scaling as (G / R) ** alpha (alpha < 1: decoding is memory-bound, a bigger batch per device
costs less than proportionally more time) and the colocated step also paying the long tail
(`tail`: the share of generation time spent waiting on the last sequences, which a partial
rollout hides).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peak_memory import ProcessPeaks  # noqa: E402
from megarl.rollout.cost_model import KINDS as PACED_KINDS  # noqa: E402

MODES = {
    "sync": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
    "sync_dp2": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
    "one_step": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
                 "actor_rollout_ref.rollout.disaggregated_ranks=1",
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
    "partial": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
                "actor_rollout_ref.rollout.disaggregated_ranks=1",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "async_training.partial_rollout=true", "async_training.partial_chunk_tokens=4"],
}
# Streaming: the rollout rank generates up to k batches ahead (staleness <= k), updates landing
# between chunks of 4 tokens.
for _k in (2, 4):
    MODES[f"stream_k{_k}"] = [*MODES["partial"], f"async_training.max_staleness={_k}"]
# The next batch starts once half of the one in flight is done, sharing the engine's calls.
MODES["stream_k2_tail"] = [*MODES["stream_k2"], "async_training.tail_overlap=0.5"]
# ... and a step takes the first finished prompt groups, not one batch's (the tail waits for a later step).
MODES["stream_k2_groups"] = [*MODES["stream_k2_tail"], "async_training.handoff=finished_groups"]
# The same stream trained with the decoupled PPO loss (AReaL's proximal policy; docs/async.md):
# the correction for samples up to 4 versions old, against stream_k4's plain clipped loss.
MODES["stream_k4_decoupled"] = [*MODES["stream_k4"], "actor_rollout_ref.actor.policy_loss.loss_mode=decoupled_ppo",
                                "actor_rollout_ref.actor.policy_loss.behav_imp_weight_cap=5"]
# The stream as built for a long tail: the next batch in the tail of the one before, steps made of
# the first finished groups, weight updates landing inside the engine's call (its K/V kept).
for _k in (2, 4):
    MODES[f"stream_k{_k}_paced"] = [*MODES[f"stream_k{_k}"], "async_training.tail_overlap=0.5",
                                    "async_training.handoff=finished_groups", "async_training.kv_after_update=keep"]
# --paced: the long-tailed task under the engine cost model (the task of docs/measurements.md's
# long-tailed section: 1 problem in 25 with 30-digit operands).
PACED = dict(long_digits=30, long_fraction=0.04)
PACED_MODES = ["sync", "one_step", "stream_k2_paced", "stream_k4_paced"]
# --seeds: held-out accuracy at equal samples, one round per seed (the correction's question)
SEED_MODES = ["sync", "stream_k4_decoupled", "stream_k4"]

# --longtail: addition where 1 problem in 10 has two 12-digit operands (answers of 13-14 tokens
# against a limit of 16) and the rest 1-2 digits (2-4 tokens): every batch waits on a few long
# responses. Data and model are built under --out.
LONGTAIL = dict(long_digits=12, long_fraction=0.1)
LONGTAIL_MODES = ["sync", "one_step", "stream_k2", "stream_k4"]


def longtail_extra(out: str, long_digits: int, long_fraction: float) -> tuple[str, list[str]]:
    from megarl.examples.addition.task import AdditionTask, write_dataset
    task = AdditionTask(long_digits=long_digits, long_fraction=long_fraction)
    train, val = write_dataset(os.path.join(out, "data"), task, n_val=128)
    kw = "actor_rollout_ref.model.bootstrap_kwargs"
    # the chat template adds ~10 tokens to a prompt; responses: the answer and EOS, with room
    prompt, response = task.max_prompt_chars() + 16, task.max_answer_chars() + 3
    positions = 64 * -(-(prompt + 2 * response) // 64)   # the engine's prompt limit + response
    return os.path.join(out, f"model-longtail-{long_digits}"), [
        f"data.train_files={os.path.abspath(train)}", f"data.val_files={os.path.abspath(val)}",
        # a partial rollout's continuation is prompt + response so far: the engine's limit covers both
        f"data.max_prompt_length={prompt}", f"data.max_response_length={response}",
        f"actor_rollout_ref.rollout.prompt_length={prompt + response}", f"{kw}.eval_rows=128",
        f"{kw}.long_digits={long_digits}", f"{kw}.long_fraction={long_fraction}",
        f"{kw}.max_position_embeddings={positions}"]


# --smoke (CI): two modes, three small steps, one round, a model warm-started for 20 steps in --out
SMOKE = dict(steps=3, test_freq=3, warmup=1, rounds=1, modes=["sync", "one_step"])
# The bootstrap is named here too: a bootstrap builds only the path its own config names (here,
# the command line's model.path under --out), never an overridden path of the quickstart's.
SMOKE_EXTRA = ["actor_rollout_ref.model.bootstrap=megarl.examples.addition:bootstrap",
               "actor_rollout_ref.model.bootstrap_kwargs.warm_start_steps=20",
               "actor_rollout_ref.model.bootstrap_kwargs.eval_rows=16", "data.train_batch_size=8",
               "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]


def run_mode(name: str, args, round_: int = 0, seed: int | None = None) -> tuple[list[dict], float, dict]:
    from megarl.trainer.metrics.logger import read_metrics
    out = os.path.join(args.out, f"{name}_{round_}")
    cmd = [sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml",
           f"trainer.default_local_dir={out}", f"trainer.total_training_steps={args.steps}",
           f"trainer.test_freq={args.test_freq}", "trainer.save_freq=-1", "trainer.resume_mode=disable",
           "algorithm.filter_groups.enable=false", f"actor_rollout_ref.model.path={args.model}",
           f"trainer.seed={args.seed if seed is None else seed}", "trainer.plot_reward_curve=false", *MODES[name],
           *args.extra]
    if args.model_bootstrap:
        cmd.append("actor_rollout_ref.model.bootstrap=megarl.examples.addition:bootstrap")
    start = time.time()
    with ProcessPeaks() as peaks:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_metrics(out), wall, {k: v for k, v in peaks.peak_mb.items() if k.startswith("rank")}


def summarise(rows: list[dict], warmup: int) -> dict:
    # Steps with a validation are left out: the sync loop validates inside the step, the async
    # one on the rollout ranks while the trainer waits, so neither is a training step's cost.
    steps = [r for r in rows if r["step"] > warmup and "timing_s/step" in r and "val/accuracy" not in r]
    step_s = statistics.median(r["timing_s/step"] for r in steps)
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    phases = {}
    # the cost model's charges per kind on the rollout side (megarl/rollout/cost_model.py), where paced
    paced = [f"rollout_paced_{k}" for k in PACED_KINDS]
    for key in ("gen", "old_log_prob", "update_actor", "sync", "wait_rollout", "rollout_gen", "rollout_wait_update",
                *paced):
        got = [r[f"timing_s/{key}"] for r in steps if f"timing_s/{key}" in r]
        if got:
            phases[key] = statistics.median(got)
    for key in ("engine_idle_fraction", "buffer_ready", "started_in_tail", "handoff_batches", "deferred_groups"):
        got = [r[f"async/{key}"] for r in steps if f"async/{key}" in r]
        if got:
            phases[key] = statistics.median(got)
    stale = [r["async/staleness_mean"] for r in rows if "async/staleness_mean" in r]
    mixed = [r["async/mixed_version_fraction"] for r in rows if "async/mixed_version_fraction" in r]
    return {"step_s": step_s, "steps_per_hour": 3600 / step_s, "val": val, "phases": phases,
            "staleness_mean": statistics.mean(stale) if stale else 0.0,
            "mixed_version_fraction": statistics.mean(mixed) if mixed else 0.0}


def expected_speedup(gen: float, train: float, sync: float, devices: int = 64, alpha: float = 0.7,
                     tail: float = 0.3) -> tuple[float, int]:
    """(speedup of one-step off-policy over colocated at `devices`, the best rollout share R),
    from one colocated step's phase seconds measured on `devices` devices as well."""
    colocated = gen + train + sync
    best = (0.0, 0)
    for r in range(1, devices):
        g = (1 - tail) * gen * (devices / r) ** alpha        # the tail is hidden by streaming/partial rollouts
        t = train * devices / (devices - r)
        speed = colocated / (max(g, t) + sync)
        best = max(best, (speed, r))
    return best


def plot(results: dict, path: str, label: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name, (rows, *_) in results.items():
        t0 = rows[0]["time"]
        pts = [(r["time"] - t0, r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        ax.plot(*zip(*pts), "o-", label=name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(label or "addition task: sync colocated vs one-step off-policy vs partial rollout", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def paced_report(summary: dict, results: dict, args) -> None:
    """--paced: the speed-ups against the goals, the time to a held-out accuracy and the sync step's
    phases, each line labelled with the cost model."""
    print(f"[{args.label}]")
    base, one = summary.get("sync"), summary.get("one_step")
    for name, s in summary.items():
        over = [f"{ref['step_s'] / s['step_s']:.2f}x {what}" for ref, what in ((one, "one_step"), (base, "sync"))
                if ref]
        phases = " ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        print(f"  {name:16s} {s['step_s']:.2f} s/step, {', '.join(over)} | {phases} (under the cost model)")
    print("  the model's seconds per step by kind, median (rollout side; the sync loop does not log them):")
    for name, s in summary.items():
        split = [f"{k} {s['phases'][f'rollout_paced_{k}']:.2f}" for k in PACED_KINDS
                 if f"rollout_paced_{k}" in s["phases"]]
        if split:
            total = sum(s["phases"][f"rollout_paced_{k}"] for k in PACED_KINDS if f"rollout_paced_{k}" in s["phases"])
            print(f"  {name:16s} {' '.join(split)} (sum of medians {total:.2f} s; under the cost model)")
    if base and "gen" in base["phases"]:
        print(f"  sync step: generation {base['phases']['gen'] / base['step_s']:.0%} of it (under the cost model)")
    # wall time: the sum of every step's time (a median hides the slow steps), and without the
    # validation steps (the same validation work in every mode)
    walls = {name: [sum(r["timing_s/step"] for r in rows if r["step"] > 0 and "timing_s/step" in r and
                        (every or "val/accuracy" not in r)) for every in (True, False)]
             for name, (rows, *_) in results.items()}
    for name, (whole, steps) in walls.items():
        over = [f"{walls[ref][0] / whole:.2f}x / {walls[ref][1] / steps:.2f}x {ref}"
                for ref in ("one_step", "sync") if ref in walls]
        print(f"  {name:16s} wall of the steps {whole:.1f} s, without validation steps {steps:.1f} s: "
              f"{', '.join(over)} (first round; under the cost model)")
    finals = [x for s in summary.values() for x in s["final_val_per_round"] if x is not None]
    target = args.target_accuracy if args.target_accuracy is not None else min(finals, default=None)
    if target is None:
        return
    starts = [next((r["val/accuracy"] for r in rows if "val/accuracy" in r), None) for rows, *_ in results.values()]
    if all(x is not None and x >= target for x in starts):
        print(f"  every mode starts at or above held-out accuracy {target:.3f}: the time to it says nothing here")
        return
    for name, (rows, *_) in results.items():
        t0 = rows[0]["time"]
        hit = next((r["time"] - t0 for r in rows if r.get("val/accuracy", -1) >= target), None)
        when = f"{hit:.0f} s" if hit is not None else "not reached"
        print(f"  {name:16s} wall time to held-out accuracy {target:.3f}: {when} (under the cost model)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="runs/models/addition-qwen2")
    ap.add_argument("--out", default="runs/bench/async")
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every mode")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--gen", type=float)
    ap.add_argument("--train", type=float)
    ap.add_argument("--sync", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE} and {SMOKE_EXTRA}")
    ap.add_argument("--seeds", type=int, nargs="+",
                    help=f"one round per seed (trainer.seed), modes {' '.join(SEED_MODES)} unless --modes; prints "
                         "each mode's final held-out accuracy per seed, mean and spread")
    ap.add_argument("--longtail", action="store_true",
                    help=f"the long-tailed task, modes {' '.join(LONGTAIL_MODES)} unless --modes")
    ap.add_argument("--long-digits", type=int, default=LONGTAIL["long_digits"])
    ap.add_argument("--long-fraction", type=float, default=LONGTAIL["long_fraction"])
    ap.add_argument("--paced", action="store_true",
                    help=f"the long-tailed task {PACED} under the engine cost model, modes {' '.join(PACED_MODES)}")
    ap.add_argument("--pace-scale", type=float, default=100.0,
                    help="--paced: the cost model's scale (the H100's times, stretched to a CPU trainer's)")
    ap.add_argument("--target-accuracy", type=float,
                    help="--paced: wall time to this held-out accuracy (default: the lowest final one of the modes)")
    ap.add_argument("--engine-only", action="store_true", help="--longtail: generation alone, whole batch vs chunks")
    ap.add_argument("--batches", type=int, default=16, help="--engine-only: batches timed")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="--engine-only: the engine's device")
    ap.add_argument("--phases", action="store_true",
                    help="--engine-only: seconds in prefill, decode steps and the rest per schedule (synchronised)")
    args = ap.parse_args()
    args.model_bootstrap, args.label = False, ""
    if args.paced:
        from megarl.rollout.cost_model import CostModelConfig, describe
        # the label is the model the runs get: --extra may override its terms
        prefix = "actor_rollout_ref.rollout.cost_model."
        terms = {k[len(prefix):]: float(v) for k, _, v in (e.partition("=") for e in args.extra)
                 if k.startswith(prefix) and k[len(prefix):] not in ("enable", "scale")}
        args.label = describe(CostModelConfig(enable=True, scale=args.pace_scale, **terms))
        vars(args).update(longtail=True, long_digits=PACED["long_digits"], long_fraction=PACED["long_fraction"],
                          extra=["actor_rollout_ref.rollout.cost_model.enable=true",
                                 f"actor_rollout_ref.rollout.cost_model.scale={args.pace_scale}", *args.extra])
        if "--modes" not in sys.argv:
            args.modes = PACED_MODES
    if args.longtail:
        model, extra = longtail_extra(args.out, args.long_digits, args.long_fraction)
        if "--modes" not in sys.argv and not args.paced:
            args.modes = LONGTAIL_MODES
        vars(args).update(model=model, extra=extra + args.extra, model_bootstrap=True)
    if args.engine_only:
        if not args.longtail:
            raise SystemExit("--engine-only measures the long-tailed task: add --longtail")
        from benchmarks.async_engine import engine_only
        return engine_only(args)
    if args.seeds:
        args.rounds = len(args.seeds)
        if "--modes" not in sys.argv:
            args.modes = SEED_MODES
    if args.smoke:
        vars(args).update(SMOKE, model=os.path.join(args.out, "model"), extra=SMOKE_EXTRA + args.extra)
    if args.model_only:
        for alpha in (1.0, 0.7, 0.5):
            for tail in (0.0, 0.3):
                s, r = expected_speedup(args.gen, args.train, args.sync, alpha=alpha, tail=tail)
                print(f"alpha {alpha:.1f} tail {tail:.1f}: {s:.2f}x with {r} of 64 devices generating")
        return
    os.makedirs(args.out, exist_ok=True)
    # The modes alternate, round after round, so a load change on the machine hits each alike.
    runs = {name: [] for name in args.modes}
    for k in range(args.rounds):
        for name in args.modes:
            runs[name].append(run_mode(name, args, k, args.seeds[k] if args.seeds else None))
    results = {name: r[0] for name, r in runs.items()}
    summary = {}
    for name, rs in runs.items():
        per_round = [summarise(rows, args.warmup) for rows, _, _ in rs]
        summary[name] = per_round[0]
        summary[name]["step_s"] = statistics.median(x["step_s"] for x in per_round)
        summary[name]["steps_per_hour"] = 3600 / summary[name]["step_s"]
        summary[name]["step_s_per_round"] = [x["step_s"] for x in per_round]
        summary[name]["final_val_per_round"] = [x["val"].get(args.steps) for x in per_round]
        summary[name]["peak_resident_mb"] = {k: max(p.get(k, 0) for _, _, p in rs) for k in sorted(rs[0][2])}
    base, one_step = summary.get("sync"), summary.get("one_step")
    print(f"{args.steps} steps x {args.rounds} round(s), modes alternated; {os.cpu_count()} CPU cores, load "
          f"average {os.getloadavg()[0]:.1f} at the end (shared machine: timings are noisy); steps/h from the median "
          "over rounds of each run's median "
          "step time (validation steps left out)")
    print(f"{'mode':10s} {'steps/h':>8s} {'speedup':>8s} {'vs 1-step':>9s} {'staleness':>9s} {'mixed':>6s}  "
          "val accuracy by step | median phase seconds")
    for name, s in summary.items():
        speed = f"{s['steps_per_hour'] / base['steps_per_hour']:.2f}x" if base else "-"
        over = f"{s['steps_per_hour'] / one_step['steps_per_hour']:.2f}x" if one_step else "-"
        val = " ".join(f"{k}:{v:.3f}" for k, v in sorted(s["val"].items()))
        phases = " ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        print(f"{name:10s} {s['steps_per_hour']:8.0f} {speed:>8s} {over:>9s} {s['staleness_mean']:9.2f} "
              f"{s['mixed_version_fraction']:6.2f}  {val} | {phases}")
        print(f"{'':10s} step seconds per round {' '.join(f'{x:.2f}' for x in s['step_s_per_round'])}; "
              f"final accuracy per round {' '.join(f'{x:.3f}' for x in s['final_val_per_round'] if x is not None)}; "
              "peak resident MiB " + ", ".join(f"{k} {v:.0f}" for k, v in s["peak_resident_mb"].items()))
    if args.seeds:
        print(f"final held-out accuracy at step {args.steps}, seeds {' '.join(map(str, args.seeds))}:")
        for name, s in summary.items():
            got = [x for x in s["final_val_per_round"] if x is not None]
            spread = f" +- {statistics.stdev(got):.3f} (sample std)" if len(got) > 1 else ""
            print(f"  {name:20s} {' '.join(f'{x:.3f}' for x in got)}  mean {statistics.mean(got):.3f}{spread}")
    if base:
        p = base["phases"]
        train = p.get("old_log_prob", 0) + p.get("update_actor", 0)
        for alpha, tail in ((1.0, 0.0), (0.7, 0.3)):
            s, r = expected_speedup(p.get("gen", 0), train, p.get("sync", 0), alpha=alpha, tail=tail)
            print(f"pipeline model at 64 devices from the sync phases (alpha {alpha}, tail {tail}): "
                  f"{s:.2f}x with {r} generating")
    if args.paced:
        paced_report(summary, results, args)
    path = os.path.join(args.out, "accuracy_vs_time.png")
    plot(results, path, args.label)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
