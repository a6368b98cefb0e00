"""megarl vs TRL's GRPOTrainer on the same GRPO step, side by side in one invocation.

    python benchmarks/vs_trl.py                                  # both models, megarl TP 1 and 2
    python benchmarks/vs_trl.py --models quickstart --tp 1       # one model, one layout
    python benchmarks/vs_trl.py --with-pass                      # also megarl with the old-log-prob pass (bypass off)
    python benchmarks/vs_trl.py --rounds 3                       # a busy machine: runs alternated, median round
    python benchmarks/vs_trl.py --smoke --out /tmp/vs_trl_smoke  # CI: a tiny run (exits 2 where TRL does not import)

TRL runs in its own virtual environment (it pins its own transformers), as benchmarks/trl_peer.py,
a subprocess of this script; megarl runs as users run it, `python -m megarl.train`. The TRL venv:

    python -m venv /work/venvs/trl
    /work/venvs/trl/bin/pip install torch==2.13.0 trl==1.16.0     # pin torch: the CPU wheel, never an open range
    python benchmarks/vs_trl.py --trl-python /work/venvs/trl/bin/python   # the default where it exists

The TRL interpreter is --trl-python, else the first of $MEGARL_TRL_PYTHON, this Python and
/work/venvs/trl/bin/python in which `import trl` works; where none does, one line says so (exit code 2).

The same work on both sides, per step (printed with the result; trl_peer.EQUAL holds TRL's settings):
- model: the same local HF checkpoint (built here, nothing downloaded), fp32 weights and compute;
  `quickstart`: the quickstart's 0.4M Qwen2 after its 350-step warm start; `18m`: the same family,
  hidden 512, 6 layers, FFN 1536 (~18.9M), random init (no warm start: one 1/16-vocabulary EOS per token);
- data: data/addition/train.jsonl in file order (megarl data.shuffle=false, TRL shuffle_dataset=False),
  32 prompts per step, the same tokenizer and chat template, megarl's own addition reward rule on both;
- sampling: 8 completions per prompt, at most 8 new tokens, stop at EOS, temperature 1, no top-p/top-k;
  on the random `18m` model (and with --fixed-length) exactly 8 (megarl rollout.ignore_eos=true, TRL
  generation_kwargs min_new_tokens=8): its EOS is noise and lengths drift apart between runs;
- loss: PPO clip with clip-higher eps 0.2 / 0.28 (megarl clip_ratio_low/high, TRL epsilon/epsilon_high),
  token-level aggregation (megarl loss_agg_mode=token-mean, TRL loss_type=dapo), GRPO advantages with
  the group std, no KL term (megarl use_kl_loss=false, use_kl_in_reward=false; TRL beta=0), no entropy bonus;
- updates: two optimizer steps of 128 samples per step (megarl ppo_mini_batch_size 16 x n 8, one
  micro-batch of 128; TRL per_device_train_batch_size 128, steps_per_generation 2), one epoch, AdamW
  (lr 1e-4, weight decay 0.01, betas 0.9/0.999), grad-norm clip 1.0, constant LR;
- old log-probs: TRL computes them with a forward pass here (its steps_per_generation > gradient
  accumulation); megarl takes the rollout's (bypass_mode null -> on: built-in engine at fp32), which
  --with-pass turns off to show the pass's cost.
Not equal, by design of each framework: megarl syncs weights into its engine each step (timing_s/sync),
TRL generates with the training model; TRL's DAPO normaliser is the generation batch's tokens / 2,
megarl's the mini-batch's own token count. Step seconds: TRL from a callback at the end of every second
optimizer step, megarl from the wall clock between its step records (its timing_s/step, which leaves out
the metrics and logging, is printed beside it); medians after --warmup steps. Threads: TRL uses all
cores; megarl's ranks split them (TP 2: one thread each). Realised response lengths differ by sampling
noise: each side's mean is printed.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = "/work/venvs/trl/bin/python"
# quickstart: configs/quickstart.yaml's bootstrap_kwargs, so the model is the quickstart's own
MODELS = {"quickstart": dict(warm_start_steps=350, seed=0, max_digits=2, eval_rows=512),
          "18m": dict(warm_start_steps=0, eval_rows=16, hidden_size=512, intermediate_size=1536, num_hidden_layers=6)}
# A randomly initialised model's EOS is noise, and one lucky rewarded sample moves Adam for many
# steps after it, so its response lengths drift apart between runs (measured: 6.2 vs 4.4 tokens
# between two layouts): on it every response is exactly --max-new tokens long on both sides.
FIXED_LENGTH = {"18m"}
PHASES = ("gen", "old_log_prob", "reward", "adv", "update_actor", "sync")
SMOKE = dict(models=["quickstart"], tp=[1], prompts=8, n=4, steps=1, warmup=1)
SMOKE_MODEL = dict(warm_start_steps=20, eval_rows=16)


def find_trl_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter, trl version) or (None, why)."""
    tried, last = [], "no interpreter found"
    for py in [explicit] if explicit else (os.environ.get("MEGARL_TRL_PYTHON"), sys.executable, VENV_PYTHON):
        if not py or py in tried or not os.path.exists(py):
            continue
        tried.append(py)
        got = subprocess.run([py, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
        if got.returncode == 0:
            return py, got.stdout.strip()
        last = (got.stderr.strip().splitlines() or ["?"])[-1]
    return None, f"{last} (tried {', '.join(tried)})"


def build_model(out: str, name: str, smoke: bool) -> str:
    from megarl.examples.addition import bootstrap
    path = os.path.join(out, "models", name + ("-smoke" if smoke else ""))
    kwargs = {**MODELS[name], **(SMOKE_MODEL if smoke else {})}
    return bootstrap(path, verbose=False, **kwargs)


def megarl_overrides(a, model: str, tp: int, run_dir: str, bypass: bool, fixed: bool) -> list[str]:
    ar = "actor_rollout_ref"
    return [f"{ar}.model.path={model}", f"trainer.default_local_dir={run_dir}", f"trainer.n_gpus_per_node={tp}",
            f"{ar}.actor.megatron.tensor_model_parallel_size={tp}",
            f"trainer.total_training_steps={a.warmup + a.steps}",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false",
            "trainer.resume_mode=disable", "trainer.plot_reward_curve=false", f"trainer.seed={a.seed}",
            "data.shuffle=false", f"data.train_batch_size={a.prompts}", f"data.max_response_length={a.max_new}",
            f"{ar}.rollout.n={a.n}", f"{ar}.rollout.ignore_eos={str(fixed).lower()}", f"{ar}.rollout.temperature=1.0",
            f"{ar}.rollout.top_p=1.0", f"{ar}.rollout.top_k=-1",
            f"{ar}.actor.ppo_mini_batch_size={a.prompts // 2}", f"{ar}.actor.ppo_epochs=1",
            f"{ar}.actor.ppo_micro_batch_size_per_gpu={a.prompts * a.n // 2}",
            f"{ar}.actor.log_prob_micro_batch_size_per_gpu={a.prompts * a.n // 2}",
            f"{ar}.actor.optim.lr={a.lr}", f"{ar}.actor.optim.weight_decay=0.01", f"{ar}.actor.optim.clip_grad=1.0",
            f"{ar}.actor.clip_ratio_low=0.2", f"{ar}.actor.clip_ratio_high=0.28",
            f"{ar}.actor.loss_agg_mode=token-mean",
            f"{ar}.actor.use_kl_loss=false", f"{ar}.actor.entropy_coeff=0", "algorithm.use_kl_in_reward=false",
            "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true",
            "algorithm.filter_groups.enable=false",
            f"algorithm.rollout_correction.bypass_mode={'null' if bypass else 'false'}"]


def run_megarl(a, model: str, tp: int, bypass: bool, fixed: bool) -> dict:
    from megarl.trainer.metrics.logger import read_metrics
    run_dir = os.path.join(a.out, f"megarl_{os.path.basename(model)}_tp{tp}{'' if bypass else '_pass'}")
    cmd = [sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml",
           *megarl_overrides(a, model, tp, run_dir, bypass, fixed)]
    with ProcessPeaks() as peaks:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=a.env)
    if proc.returncode:
        raise SystemExit(f"megarl TP{tp} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    every = {r["step"]: r for r in read_metrics(run_dir) if "timing_s/step" in r}
    rows = [every[k] for k in sorted(every) if k > a.warmup]
    # wall clock between consecutive step records: like TRL's callback clock, it includes all of a
    # step's work (metrics, logging), not only the phases timing_s/step covers
    wall = [every[k]["time"] - every[k - 1]["time"] for k in sorted(every) if k > a.warmup]
    med = {k: statistics.median(r.get(f"timing_s/{k}", 0.0) for r in rows) for k in ("step", *PHASES)}
    return {"step_s": statistics.median(wall), "timed_step_s": med.pop("step"), "phases": med,
            "peak_mb": max(peaks.peak_mb.values(), default=0),
            "tokens": statistics.mean(r["response_length/mean"] for r in rows),
            "bypass": all(r.get("rollout_corr/bypass_mode") == 1.0 for r in rows),
            "mismatch": max(r.get("rollout_corr/max_abs_log_prob_diff", 0.0) for r in rows)}


def run_trl(a, model: str, fixed: bool) -> dict:
    out = os.path.join(a.out, f"trl_{os.path.basename(model)}.json")
    cmd = [a.trl_python, "benchmarks/trl_peer.py", "--model", model, "--out", out, "--prompts", str(a.prompts),
           "--n", str(a.n), "--max-new", str(a.max_new), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--lr", str(a.lr), "--seed", str(a.seed), *(["--fixed-length"] if fixed else [])]
    with ProcessPeaks() as peaks:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=a.env)
    if proc.returncode:
        raise SystemExit(f"TRL failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        got = json.load(f)
    got["median_s"] = statistics.median(got["step_s"][a.warmup:])
    got["tokens"] = statistics.mean(got["mean_completion_tokens"][a.warmup:] or got["mean_completion_tokens"])
    got["peak_mb"] = max(peaks.peak_mb.values(), default=0)
    return got


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def over_rounds(results: list[dict], key: str) -> dict:
    """The round whose median step time is the median over rounds (its phases stay consistent)."""
    ranked = sorted(results, key=lambda r: r[key])
    return {**ranked[(len(ranked) - 1) // 2], "rounds": [r[key] for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="measured steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate TRL and megarl runs this many times (noisy machines)")
    ap.add_argument("--fixed-length", action="store_true",
                    help=f"every response exactly --max-new tokens on both sides (always for {sorted(FIXED_LENGTH)})")
    ap.add_argument("--with-pass", action="store_true",
                    help="also megarl with bypass_mode=false (the old-log-prob pass)")
    ap.add_argument("--trl-python", help=f"the interpreter of TRL's venv (default: see the docstring; {VENV_PYTHON})")
    ap.add_argument("--out", default="runs/bench/vs_trl")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}, model {SMOKE_MODEL}")
    a = ap.parse_args()
    if a.smoke:
        vars(a).update(SMOKE)
    a.trl_python, version = find_trl_python(a.trl_python)
    if a.trl_python is None:
        print(f"vs_trl: TRL does not import: {version}; build its venv (see benchmarks/vs_trl.py's docstring) "
              "or pass --trl-python")
        raise SystemExit(2)
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    # Sleeping OpenMP waits on both sides: spinning threads stall whenever another job holds a core.
    a.env = {**os.environ, "PYTHONPATH": ROOT, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    print(f"TRL {version} ({a.trl_python}); {a.prompts} prompts x {a.n} samples per step, <= {a.max_new} new tokens, "
          f"2 optimizer updates of {a.prompts * a.n // 2} samples, fp32, no KL; medians of {a.steps} steps after "
          f"{a.warmup} warm-up; {os.cpu_count()} CPU cores")
    table = []
    for name in a.models:
        model = build_model(a.out, name, a.smoke)
        fixed = name in FIXED_LENGTH or a.fixed_length
        arms = [(tp, True) for tp in a.tp] + ([(tp, False) for tp in a.tp] if a.with_pass else [])
        trls, ours = [], {arm: [] for arm in arms}
        for _ in range(a.rounds):      # TRL, then each megarl arm, round after round: load changes hit all
            trls.append(run_trl(a, model, fixed))
            for arm in arms:
                ours[arm].append(run_megarl(a, model, *arm, fixed))
        trl, ours = over_rounds(trls, "median_s"), {arm: over_rounds(rs, "step_s") for arm, rs in ours.items()}
        params = trl["parameters"]
        print(f"\nmodel {name}: Qwen2, {params / 1e6:.2f}M parameters; responses "
              f"{'exactly' if fixed else 'up to'} {a.max_new} tokens; TRL config {json.dumps(trl['config'])}")
        print(f"  TRL GRPOTrainer      {trl['median_s']:7.3f} s/step  (rounds {fmt(trl['rounds'])}; "
              f"response tokens/sample {trl['tokens']:.2f}, "
              f"{trl['optimizer_steps']} optimizer steps, {trl['threads']} threads, peak resident MiB "
              f"{trl['peak_mb']:.0f})")
        for (tp, bypass), r in ours.items():
            label = f"megarl TP{tp}" + ("" if bypass else " +pass")
            phases = " ".join(f"{k} {v:.3f}" for k, v in r["phases"].items() if v)
            print(f"  {label:20s} {r['step_s']:7.3f} s/step  ratio megarl TP{tp}{'' if bypass else ' +pass'} / TRL = "
                  f"{r['step_s'] / trl['median_s']:.2f}x  (rounds {fmt(r['rounds'])}; "
                  f"response tokens/sample {r['tokens']:.2f}, old-log-prob pass "
                  f"{'skipped' if r['bypass'] else 'run'}, max |rollout - trainer log-prob| {r['mismatch']:.1e}, "
                  f"peak resident MiB {r['peak_mb']:.0f})")
            print(f"  {'':20s} phases (median s): {phases}; timing_s/step {r['timed_step_s']:.3f}")
            table.append((name, tp, bypass, trl["median_s"], r["step_s"]))
    arms = [f"megarl TP{tp}" + ("" if b else " +pass") for n, tp, b, _, _ in table if n == table[0][0]]
    print("\n| model | TRL s/step | " + " | ".join(arms) + " |\n|---|---|" + "---|" * len(arms))
    for name in a.models:
        cells = [(t, m) for n, _, _, t, m in table if n == name]
        print(f"| {name} | {cells[0][0]:.3f} | " + " | ".join(f"{m:.3f} ({m / t:.2f}x)" for t, m in cells) + " |")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
