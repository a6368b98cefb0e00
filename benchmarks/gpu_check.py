"""One command for a GPU machine: run tests/gpu and the GPU benchmarks, write one report.

    python benchmarks/gpu_check.py [--out gpu_check_report]        # on a GPU node (~10-20 min on one H100)
    python benchmarks/gpu_check.py --tests-timeout 300             # a time-boxed node: tests/gpu stops at 300 s
    python benchmarks/gpu_check.py --device cpu --dry-run          # the report's plumbing, on CPU, in ~1 min

Writes <out>/gpu_check.md and <out>/gpu_check.json: the GPU and versions (torch, CUDA,
megatron-core, transformers, Transformer Engine), a bf16 8192^3 matmul (what the GPU really
reaches), tests/gpu (pass/fail, the bf16 rollout-vs-trainer log-prob mismatch, resume), the
update-step benchmark on the 0.86B shape (update_policy and compute_log_prob MFU against the
0.45 MFU target, peak memory per phase and --check's memory plan against it, what offload
frees against the <= 10% target, weight-sync seconds and GB/s), rollout tokens/s of the built-in
engine against transformers' generate, the stream's schedule on the long-tailed task
(tail_overlap against whole-batch calls, generation alone), and megarl's vLLM adapter on vLLM's
CUDA build where it imports (benchmarks/vllm_gpu_check.py; else one line says why it skipped:
the dry run always skips it), and the engine cost model's terms on this GPU against its defaults
(benchmarks/cost_model_check.py: decode step time against rows, prefill time against prompt
tokens, the fitted terms and whether the defaults are within 2x). Without CUDA (and without
--device cpu) it says so in one line and exits 2.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.plan_vs_measured import compare, table as plan_table  # noqa: E402
from benchmarks import cost_model_check, vllm_gpu_check  # noqa: E402

MFU_TARGET = 0.45              # update_policy's MFU goal on the 0.86B benchmark shape
OFFLOAD_TARGET = 0.10          # offload's goal: trainer memory on device during rollout / before offload


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("megatron-core", "transformers", "transformer-engine", "transformer_engine", "flash-attn"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        out["megarl_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None
    except OSError:
        out["megarl_commit"] = None
    return out


def device_info(device: str) -> dict:
    if device != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}
    p = torch.cuda.get_device_properties(0)
    return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "memory_gb": p.total_memory / 2**30, "capability": f"{p.major}.{p.minor}"}


def matmul(device: str, dry: bool) -> dict:
    n, dtype = (512, torch.float32) if dry else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(3 if dry else 13):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    best = sorted(times[1:])[len(times[1:]) // 2]
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "tflops": 2 * n**3 / best / 1e12}


OUTCOME = re.compile(r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def run_tests(out: str, timeout_s: float | None = None) -> dict:
    """tests/gpu, each test's outcome as it finishes (-v): a run stopped at `timeout_s` (a GPU lent
    for minutes) still reports what passed and what failed before the stop."""
    figures = os.path.join(out, "tests")
    junit = os.path.join(out, "tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "tests/gpu", f"--junitxml={junit}"]
    env = {**os.environ, "MEGARL_GPU_REPORT": figures, "PYTHONPATH": ROOT}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout_s)
        stdout, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        code = "timeout"
    outcomes = dict(OUTCOME.findall(stdout))
    summary = (stdout.strip().splitlines()[-1] if stdout.strip() and code != "timeout" else
               f"stopped after {timeout_s:g} s: " + ", ".join(f"{sum(v == k for v in outcomes.values())} {k.lower()}"
                                                          for k in ("PASSED", "FAILED", "SKIPPED")))
    got = {}
    if os.path.isdir(figures):
        for name in sorted(os.listdir(figures)):
            with open(os.path.join(figures, name)) as f:
                got[name[:-5]] = json.load(f)
    return {"returncode": code, "summary": summary, "outcomes": outcomes, "figures": got,
            "tail": stdout[-4000:] if code else ""}


def update_step(device: str, dry: bool, micro: int) -> dict:
    from benchmarks.gpu_update_step import run, table
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model") if dry else "/tmp/megarl_gpu_check_0.86b"
        args = ["--micro", str(micro), "--json", os.devnull, "--model-dir", model_dir]
        args += ["--smoke"] if dry else ["--device", device, "--shape", "0.86b"]
        result = run(args)
        print(table(result), flush=True)
        # --check's memory plan against these measurements: static bytes exact, the update's peak estimated
        with open(os.path.join(model_dir, "config.json")) as f:
            result["memory_plan"] = compare(json.load(f), result)
    print("  memory plan vs measured: " + plan_table(result["memory_plan"]), flush=True)
    return result


def rollout(device: str, dry: bool, out: str) -> dict:
    from benchmarks.rollout_throughput import main
    if dry:
        args = ["--device", device, "--smoke", "--model-dir", os.path.join(out, "rollout_model_dry")]
    else:
        # the 0.86B benchmark shape (the toy tokenizer's vocabulary is what it trains to, <= 32768)
        args = ["--device", device, "--dtype", "bfloat16", "--layers", "16", "--hidden", "2048", "--heads", "16",
                "--kv-heads", "4", "--intermediate", "5632", "--vocab-size", "32768", "--prompts", "64", "--n", "4",
                "--max-tokens", "256", "--repeats", "3",
                "--model-dir", "/tmp/megarl_gpu_check_rollout"]
    return {"tokens_per_s": main(args), "args": args}


def stream(device: str, dry: bool, out: str) -> dict:
    """The stream's schedule with tail_overlap=0.5 against whole-batch calls, generation alone on
    the long-tailed task (benchmarks/async_engine.py; docs/async.md). The task's model is
    warm-started on the CPU first (~1.5 min; 20 steps and a 12-digit tail at the dry run)."""
    args = ["--longtail", "--engine-only", "--phases", "--device", device, "--out", os.path.join(out, "stream")]
    if dry:
        args += ["--long-digits", "12", "--long-fraction", "0.1", "--batches", "2", "--extra",
                 "actor_rollout_ref.model.bootstrap_kwargs.warm_start_steps=20",
                 "actor_rollout_ref.model.bootstrap_kwargs.eval_rows=16"]
    else:
        args += ["--long-digits", "30", "--long-fraction", "0.04", "--batches", "16"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "async_speedup.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode:
        raise RuntimeError(f"async_speedup.py --engine-only exited {proc.returncode}: {proc.stderr[-1500:]}")
    got = {}
    for name in ("whole-batch calls", "next batch in the tail, pausable"):
        m = re.search(rf"  {re.escape(name)} +([\d.]+) s +[\d.]+x +\((.*)\)", proc.stdout)
        if m is None:
            raise RuntimeError(f"no '{name}' line in the benchmark's output")
        got[name] = {"s_per_batch": float(m.group(1)), "counters": m.group(2)}
    got["speedup"] = got["whole-batch calls"]["s_per_batch"] / got["next batch in the tail, pausable"]["s_per_batch"]
    return got


def section(name: str, fn, *args) -> dict:
    t = time.perf_counter()
    try:
        return {"name": name, "ok": True, "result": fn(*args), "seconds": time.perf_counter() - t}
    except BaseException as err:  # one failing section must not lose the others' figures
        if isinstance(err, KeyboardInterrupt):
            raise
        return {"name": name, "ok": False, "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-3000:], "seconds": time.perf_counter() - t}


def derived(sections: list[dict]) -> list[dict]:
    """The MFU and offload figures against their targets (MFU_TARGET, OFFLOAD_TARGET), from the update-step sections."""
    by = {s["name"]: s for s in sections}
    mfu, off = {}, {}
    for name, s in by.items():
        if name.startswith("update_step") and s["ok"]:
            r = s["result"]
            mfu[name] = {k: r.get(k) for k in ("micro", "distributed_optimizer", "update_policy_mfu",
                                               "compute_log_prob_mfu", "update_policy_tflops", "peak_tflops")}
            o = r["offload"]
            off[name] = {**o, "held_ratio": o["resident_gb_after"] / max(o["resident_gb_before"], 1e-12)}
    best = max((m["update_policy_mfu"] or 0 for m in mfu.values()), default=None)
    return [{"name": "mfu", "ok": bool(mfu), "result": {"runs": mfu, "best_update_policy_mfu": best,
                                                        "target": MFU_TARGET,
                                                        "meets_target": best is not None and best >= MFU_TARGET}},
            {"name": "offload", "ok": bool(off), "result": {"runs": off, "target_held_ratio": OFFLOAD_TARGET}}]


def verdict(best: float, r: dict) -> str:
    return f"{best:.3f}: " + ("met" if r["meets_target"] else f"short by {r['target'] - best:.3f}")


def markdown(rep: dict) -> str:
    d, v = rep["device"], rep["versions"]
    lines = [f"# megarl gpu check, {rep['date']}", "",
             f"- device: {d['name']} x {d['count']}" + (f", {d['memory_gb']:.0f} GiB" if "memory_gb" in d else ""),
             "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"- dry run: {rep['dry_run']}", "", "| check | figure |", "|---|---|"]
    for s in rep["sections"]:
        if not s["ok"]:
            lines.append(f"| {s['name']} | FAILED: {s.get('error', '')[:200]} |")
            continue
        r = s["result"]
        if s["name"] == "matmul":
            lines.append(f"| matmul {r['dtype']} {r['n']}^3 | {r['tflops']:.3g} TFLOP/s |")
        elif s["name"] == "tests":
            lines.append(f"| tests/gpu | {r['summary']} (exit {r['returncode']}) |")
            for test, outcome in r.get("outcomes", {}).items():
                if outcome in ("FAILED", "ERROR"):
                    lines.append(f"| {outcome.lower()} | {test} |")
            for name, fig in r["figures"].items():
                if "mismatch_max_over_steps" in fig:
                    mm = fig["mismatch_max_over_steps"]
                    lines.append(f"| mismatch bf16 ({name}) | k3_kl {mm['rollout_corr/k3_kl']:.2e}, prob diff mean "
                                 f"{mm['training/rollout_probs_diff_mean']:.2e}, max abs log-prob "
                                 f"{mm['rollout_corr/max_abs_log_prob_diff']:.3f} |")
        elif s["name"].startswith("update_step"):
            for k in ("update_policy", "compute_log_prob"):
                mfu = r.get(f"{k}_mfu")
                lines.append(f"| {k} MFU (micro {r['micro']}, {r['shape']}) | "
                             + (f"{mfu:.3g}" if mfu is not None else "n/a")
                             + f" ({r[k + '_s']:.3f} s, {r[k + '_tflops']:.3g} TFLOP/s) |")
            w = r["weight_sync"]
            lines.append(f"| weight sync (micro {r['micro']} run) | {w['seconds']:.3f} s, {w['gb_per_s']:.2f} GB/s |")
            mem = ", ".join(f"{k.split('/')[1]} {val:.2f}" for k, val in r["memory"].items())
            lines.append(f"| peak memory per phase, GB | {mem} |")
            if "memory_plan" in r:
                lines.append(f"| memory plan vs measured (micro {r['micro']}) | {plan_table(r['memory_plan'])} |")
        elif s["name"] == "rollout":
            tps = r["tokens_per_s"]
            lines.append("| rollout tokens/s | " + ", ".join(f"{k} {val:.0f}" for k, val in tps.items())
                         + (f" (native / hf {tps['native'] / tps['hf']:.2f}x)" if "hf" in tps else "") + " |")
        elif s["name"] == "stream":
            whole, tail = r["whole-batch calls"], r["next batch in the tail, pausable"]
            lines.append(f"| stream schedule, generation alone (tail_overlap 0.5 vs whole-batch calls) | "
                         f"{tail['s_per_batch']:.3f} vs {whole['s_per_batch']:.3f} s per batch: "
                         f"{r['speedup']:.2f}x ({tail['counters']} vs {whole['counters']}) |")
        elif s["name"] == "vllm":
            lines.extend(vllm_gpu_check.rows(r))
        elif s["name"] == "cost_model":
            lines.extend(cost_model_check.rows(r))
        elif s["name"] == "mfu":
            best = r["best_update_policy_mfu"]
            lines.append(f"| update_policy MFU vs target {r['target']} | "
                         + (verdict(best, r) if best is not None else "n/a") + " |")
        elif s["name"] == "offload":
            for name, o in r["runs"].items():
                lines.append(f"| offload ({name}) | trainer state on device {o['resident_gb_before']:.2f} -> "
                             f"{o['resident_gb_after']:.2f} GB (held {o['held_ratio']:.1%}, target <= "
                             f"{r['target_held_ratio']:.0%}); onload {o['onload_s']:.3f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_report")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, no tests/gpu: checks the report plumbing")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tests-timeout", type=float, default=None,
                    help="stop tests/gpu after this many seconds (the report keeps each finished test's outcome)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU node, "
              "or `--device cpu --dry-run` to check the report plumbing")
        return 2
    os.makedirs(a.out, exist_ok=True)
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device_info(a.device), "versions": versions(), "dry_run": a.dry_run, "sections": []}
    secs = rep["sections"]
    secs.append(section("matmul", matmul, a.device, a.dry_run))
    if not (a.dry_run or a.skip_tests):
        secs.append(section("tests", run_tests, a.out, a.tests_timeout))
    for micro in ((2,) if a.dry_run else (4, 8)):
        secs.append(section(f"update_step_micro{micro}", update_step, a.device, a.dry_run, micro))
    secs.append(section("rollout", rollout, a.device, a.dry_run, a.out))
    secs.append(section("stream", stream, a.device, a.dry_run, a.out))
    secs.append(section("vllm", vllm_gpu_check.run, "cpu" if a.dry_run else a.device, a.dry_run, a.out))
    secs.append(section("cost_model", cost_model_check.run, a.device, a.dry_run, a.out))
    secs.extend(derived(secs))
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    text = markdown(rep)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"gpu_check: wrote {a.out}/gpu_check.md and gpu_check.json")
    return 0 if all(s["ok"] for s in secs) and all(s["result"]["returncode"] == 0 for s in secs
                                                   if s["name"] == "tests" and s["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
