"""What routing replay removes, on a tiny Qwen3-MoE: R3 (engine -> trainer) and R2 (old-policy
pass -> update), each off and on, then a short GRPO run with R3 off and on.

    python benchmarks/routing_replay.py                  # the table, then the GRPO runs and the PNG
    python benchmarks/routing_replay.py --grpo-steps 0   # the table only
    python benchmarks/routing_replay.py --smoke          # CI: a random tiny model, 1 GRPO step with R3

Part 1 (one process): the built-in engine samples in bf16 and records its routes; megarl's
megatron actor scores the same batch in fp32 (bf16 training needs CUDA in megarl). Rows:
- R3 off / on: engine vs the trainer's log-prob pass (on: the pass replays the engine's routes).
- R2 off / on: the old-policy pass (log-prob micro-batch = the whole batch, its own routes
  recorded) vs the first update forward (the update's micro-batches; on: they replay them).
Columns: the fraction of (token, MoE layer) decisions whose top-k set differs (the trainer's
routers are hooked, so this is what they used, in their own token order, against the reference
routes laid out the same way; the final sampled token, which no engine feeds, is not counted);
over response tokens: mean k3 KL of the two log-probs (megarl/algos/rollout_correction.py's
rollout_corr/k3_kl), max |log-prob difference|, and the importance ratio exp(lp_b - lp_a):
its standard deviation and range. Route memory is measured from the batch field.

Part 2: `megarl-train --config configs/grpo_moe_tiny.yaml` twice (rollout.dtype=bfloat16 so the
engine and the fp32 trainer differ; R3 on adds router_replay.mode=R3 and
rollout.enable_rollout_routing_replay=true), then reward and rollout_corr/k3_kl per step,
side by side, in routing_replay.png.

Measured (2 shared cores, heavily loaded; docs/moe.md has the tables): disagreement 0.2 % / 0.8 %
of decisions without R3 and 0 with it; mean KL 1.03x lower with R3 on grpo_moe_tiny's model and
4.8x on the wide shape (the rest is bf16 against fp32); R2 finds nothing to remove on CPU.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.peak_memory import ProcessPeaks  # noqa: E402
from megarl.parallel.local_ranks import run_local  # noqa: E402

ADDITION = dict(warm_start_steps=150, seed=0, max_digits=2, eval_rows=64, family="qwen3_moe")  # grpo_moe_tiny's
# Model shapes of part 1, both warm-started like grpo_moe_tiny's: its own (4 experts, top-2, 2
# layers), and a wider one with Qwen3-30B-A3B's experts-to-top-k ratio (128 / 8) and more layers,
# where near-tied routers are more common and a flip has more layers to compound through.
SHAPES = {"grpo_moe_tiny": {}, "wide": dict(num_hidden_layers=8, num_experts=32, num_experts_per_tok=2,
                                             moe_intermediate_size=32)}
SMOKE_MODEL = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)


# -- part 1 -----------------------------------------------------------------------------------------------
def rollout(path: str, prompts: list[list[int]], n: int, response: int, seed: int):
    """The engine's batch in bf16 with its routes (megarl/rollout/native/routes.py)."""
    import numpy as np

    from megarl.protocol import DataProto
    from megarl.rollout.base import SamplingParams, pack_completions
    from megarl.rollout.native import NativeEngine
    engine = NativeEngine.from_pretrained(path, dtype="bfloat16", record_routes=True)
    kept = np.empty(len(prompts), dtype=object)
    kept[:] = [list(p) for p in prompts]
    batch = DataProto.from_dict(non_tensors={"prompt_token_ids": kept})
    out = pack_completions(batch, engine.generate(prompts, SamplingParams(n=n, max_tokens=response, seed=seed)), 0)
    B, S = out.batch["input_ids"].shape
    R = out.batch["responses"].shape[1]
    out.batch["response_mask"] = (torch.arange(R)[None] < out.batch["response_lens"][:, None]).float()
    out.batch["advantages"] = torch.zeros(B, R)
    out.batch["row"] = torch.arange(B)
    return out


class RouterTap:
    """Forward hooks on every megatron router of the actor: the top-k set each one used, per call."""

    def __init__(self, chunks):
        from megatron.core.transformer.moe.router import Router
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(m.layer_number - 1))
                        for c in chunks for m in c.modules() if isinstance(m, Router)]

    def _hook(self, layer):
        def hook(module, args, output):
            self.calls.append((layer, output[1].detach().clone()))      # routing_map [tokens, experts]
        return hook

    def take(self) -> list[tuple[int, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls


def disagreement(calls, routes: torch.Tensor, lens: torch.Tensor, packed: bool) -> tuple[int, int]:
    """(differing, counted) (token, layer) decisions of one micro-batch's router calls against
    `routes` [b, S, L, K] laid out in the routers' token order (megarl/models/routing_replay.py)."""
    from megarl.models import routing_replay as rr
    b = 1 if packed else len(lens)
    counted = torch.zeros(*routes.shape[:2], 1, 1, dtype=torch.long)       # the positions a decision counts at
    for i, n in enumerate(lens.tolist()):
        counted[i, :n - 1] = 1                                             # not the never-fed final token
    bad = total = 0
    for layer, rmap in calls:
        cols = rmap.shape[0] // b
        want = rr.local_tokens(rr.micro_routes(routes, lens, packed, cols), layer)
        use = rr.local_tokens(rr.micro_routes(counted.expand(-1, -1, routes.shape[2], 1), lens, packed, cols),
                              layer)[:, 0].bool()
        want_map = torch.zeros_like(rmap).scatter_(1, want, True)
        bad += int(((want_map != rmap).any(-1) & use).sum())
        total += int(use.sum())
    return bad, total


def gap(lp_a: torch.Tensor, lp_b: torch.Tensor, mask: torch.Tensor) -> dict:
    from megarl.algos.rollout_correction import rollout_mismatch_metrics
    m = mask > 0
    ratio = (lp_b - lp_a)[m].exp()
    return {"k3_kl": rollout_mismatch_metrics(lp_b, lp_a, mask)["rollout_corr/k3_kl"],
            "max_abs": float((lp_b - lp_a)[m].abs().max()), "ratio_std": float(ratio.std()),
            "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max())}


def measure(rank, world, path: str, prompts, a) -> dict:
    from dataclasses import replace

    from megarl.models import routing_replay as rr
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, ModelConfig, OptimConfig, RouterReplayConfig
    batch = rollout(path, prompts, a.n, a.response, a.seed)
    B = len(batch)
    lens = batch.batch["prompt_lens"] + batch.batch["response_lens"]
    mask = batch.batch["response_mask"]
    engine_routes = batch.batch[rr.KEY]
    cfg = ActorConfig(ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=a.micro, log_prob_micro_batch_size_per_gpu=B,
                      optim=OptimConfig(lr=1e-5), router_replay=RouterReplayConfig(mode="R2"))
    state.init_distributed()   # the rank set-up: the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path), cfg)
    packed = actor.engine.schedule.packed          # THD rows back to back (the default) or right-padded
    tap = RouterTap(actor.engine.chunks)
    rows: dict[str, dict] = {}

    # R3 off: the trainer routes itself (recording them is R2's old-policy pass).
    lp_old, _, own = actor.compute_log_prob(batch, 1.0, record_routes=True)
    bad, total = disagreement(tap.take(), engine_routes, lens, packed)
    flips = [int((own[i, :n - 1].sort(-1).values != engine_routes[i, :n - 1].long().sort(-1).values)
                 .any(-1).sum()) for i, n in enumerate(lens.tolist())]
    if sum(flips) != bad:                  # the hooks and the batch-layout record must tell the same story
        raise RuntimeError(f"router hooks count {bad} differing decisions, the recorded routes {sum(flips)}")
    flipped = torch.tensor(flips) > 0      # sequences with at least one differing decision
    rows["R3 off"] = {"disagree": bad / total, **gap(batch.batch["rollout_log_probs"], lp_old, mask)}

    # R3 on: the same pass replays the engine's routes.
    actor.cfg = replace(cfg, router_replay=RouterReplayConfig(mode="R3"))
    lp_r3, _ = actor.compute_log_prob(batch, 1.0)
    bad, total = disagreement(tap.take(), engine_routes, lens, packed)
    rows["R3 on"] = {"disagree": bad / total, **gap(batch.batch["rollout_log_probs"], lp_r3, mask)}
    if flipped.any():                      # the same two passes on the sequences a flip touched
        fmask = mask * flipped[:, None]
        rows["R3 off"]["flipped_kl"] = gap(batch.batch["rollout_log_probs"], lp_old, fmask)["k3_kl"]
        rows["R3 on"]["flipped_kl"] = gap(batch.batch["rollout_log_probs"], lp_r3, fmask)["k3_kl"]

    # R2: the old-policy pass's own routes vs the first update forward (before any optimizer step).
    old = batch.clone()
    old.batch[rr.KEY] = own.to(engine_routes.dtype)
    for name, routes in (("R2 off", None), ("R2 on", "replay")):
        got, counts = torch.zeros_like(lp_old), [0, 0]

        def loss_fn(out, mb):
            got[mb.batch["row"]] = out["log_probs"].detach()
            mb_lens = mb.batch["prompt_lens"] + mb.batch["response_lens"]
            b, t = disagreement(tap.take(), mb.batch[rr.KEY], mb_lens, packed)
            counts[0] += b
            counts[1] += t
            return (out["log_probs"] * mb.batch["response_mask"]).sum() * 0.0, {}
        actor.engine.accumulate(old, a.micro, actor._process(1.0, True), loss_fn, routes=routes)
        rows[name] = {"disagree": counts[0] / counts[1], **gap(lp_old, got, mask)}
    for h in tap.handles:
        h.remove()
    L, K = engine_routes.shape[2:]
    return {"rows": rows, "B": B, "tokens": int(lens.sum()), "layers": L, "topk": K, "flipped": int(flipped.sum()),
            "dtype": str(engine_routes.dtype), "bytes_per_slot": engine_routes.element_size(),
            "route_bytes_per_token": L * K * engine_routes.element_size(),
            "experts": actor.engine.spec.num_experts}


def table(res: dict) -> str:
    head = f"{'':8} {'disagree':>9} {'mean KL (k3)':>13} {'max |dlogp|':>12} {'ratio std':>10} {'ratio range':>18}"
    lines = [head]
    for name, r in res["rows"].items():
        lines.append(f"{name:8} {r['disagree']:9.4f} {r['k3_kl']:13.3e} {r['max_abs']:12.3e} {r['ratio_std']:10.3e} "
                     f"[{r['ratio_min']:.4f}, {r['ratio_max']:.4f}]")
    off, on = res["rows"]["R3 off"], res["rows"]["R3 on"]
    lines.append(f"R3: mean KL {off['k3_kl'] / max(on['k3_kl'], 1e-30):.2f}x lower with replay"
                 + (f"; on the {res['flipped']} of {res['B']} sequences a flip touched "
                    f"{off['flipped_kl']:.3e} -> {on['flipped_kl']:.3e} "
                    f"({off['flipped_kl'] / max(on['flipped_kl'], 1e-30):.2f}x)" if "flipped_kl" in off else
                    "; no routing decision flipped"))
    lines.append(f"routes {res['dtype']}, "
                 f"{res['bytes_per_slot']} byte per token per MoE layer per slot "
                 f"({res['layers']} layers x top-{res['topk']} = {res['route_bytes_per_token']} bytes per token)")
    return "\n".join(lines)


# -- part 2 -----------------------------------------------------------------------------------------------
def grpo(run_dir: str, steps: int, r3: bool, extra: list[str]) -> list[dict]:
    over = [f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}",
            "actor_rollout_ref.rollout.dtype=bfloat16", *extra]
    if r3:
        over += ["actor_rollout_ref.actor.router_replay.mode=R3",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    cmd = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "grpo_moe_tiny.yaml"), *over]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    from megarl.trainer.metrics.logger import read_metrics
    return [r for r in read_metrics(run_dir) if "rollout_corr/k3_kl" in r]      # training steps only


def plot(curves: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, recs in curves.items():
        steps = [r["step"] for r in recs]
        ax_r.plot(steps, [r.get("critic/score/mean", r.get("critic/rewards/mean")) for r in recs], marker="o",
                  label=name)
        ax_k.plot(steps, [r["rollout_corr/k3_kl"] for r in recs], marker="o", label=name)
    ax_r.set(title="reward (critic/score/mean)", xlabel="step")
    ax_k.set(title="rollout vs trainer mean KL (k3)", xlabel="step", yscale="log")
    for ax in (ax_r, ax_k):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="the update's micro-batch (the old-policy pass takes all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grpo-steps", type=int, default=8)
    ap.add_argument("--out", default=None, help="run directories and the PNG (default runs/routing_replay)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.prompts, a.n, a.response, a.micro, a.grpo_steps = 4, 2, 6, 2, 1
    a.out = a.out or (tempfile.mkdtemp(prefix="routing_replay-") if a.smoke
                      else os.path.join(ROOT, "runs", "routing_replay"))
    os.makedirs(a.out, exist_ok=True)
    with ProcessPeaks() as peaks:
        for shape in (["smoke"] if a.smoke else a.shapes):
            path, prompts = model_and_prompts(a, shape)
            res = run_local(1, measure, (path, prompts, a))[0]
            print(f"\n[{shape}] tiny Qwen3-MoE ({res['experts']} experts, top-{res['topk']}, {res['layers']} MoE "
                  f"layers), {res['B']} sequences / {res['tokens']} tokens; engine bf16, trainer fp32")
            print(table(res))
        if a.grpo_steps > 0:
            extra = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"] if a.smoke else []
            arms = (("R3 on", True),) if a.smoke else (("R3 off", False), ("R3 on", True))   # smoke: the new path
            curves = {name: grpo(os.path.join(a.out, name.replace(" ", "_")), a.grpo_steps, r3, extra)
                      for name, r3 in arms}
            png = os.path.join(a.out, "routing_replay.png")
            plot(curves, png)
            for name, recs in curves.items():
                print(f"GRPO {name}: k3 KL per step " + " ".join(f"{r['rollout_corr/k3_kl']:.2e}" for r in recs))
            print(f"wrote {png}")
    print(peaks.line())


def model_and_prompts(a, shape: str) -> tuple[str, list[list[int]]]:
    """Smoke: a random tiny Qwen3-MoE and random prompts. Otherwise the addition model warm-started
    as grpo_moe_tiny's is (that one is built on first use, as the config builds it; SHAPES) and
    its task's prompts."""
    import random
    if shape == "smoke":
        from megarl.models.tiny import make_tiny_hf
        path = make_tiny_hf(os.path.join(a.out, "model"), "qwen3_moe", tokenizer=False, **SMOKE_MODEL)
        # make_tiny_hf makes routing clear-cut for parity tests; back to transformers' init scale
        # (std 0.02) here, so near-ties exist and the smoke run has flips for R3 to remove.
        from safetensors.torch import load_file, save_file
        weights = load_file(os.path.join(path, "model.safetensors"))
        for name in weights:
            if name.endswith("mlp.gate.weight"):
                weights[name] = weights[name] * 0.04
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        rng = random.Random(a.seed)
        return path, [[rng.randrange(3, 301) for _ in range(rng.randrange(4, 9))] for _ in range(a.prompts)]
    from transformers import AutoTokenizer

    from megarl.examples.addition import bootstrap
    from megarl.examples.addition.task import AdditionTask, prompt_text
    name = "addition-qwen3moe" if shape == "grpo_moe_tiny" else f"addition-qwen3moe-{shape}"
    path = bootstrap(os.path.join(ROOT, "runs", "models", name), **ADDITION, **SHAPES[shape])
    tok = AutoTokenizer.from_pretrained(path)
    problems = AdditionTask(max_digits=ADDITION["max_digits"]).problems(seed=a.seed + 1)
    return path, [tok.encode(prompt_text(*next(problems)), add_special_tokens=False) for _ in range(a.prompts)]


if __name__ == "__main__":
    main()
