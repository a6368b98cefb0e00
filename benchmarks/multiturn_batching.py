"""Multi-turn rollouts: turns batched across trajectories vs one trajectory at a time, side by side.

    python benchmarks/multiturn_batching.py [--prompts 32] [--n 4] [--repeats 3] [--threads 1]
    python benchmarks/multiturn_batching.py --smoke       # CI: 2 prompts, a 20-step model, one repeat

The tool-use model of megarl/examples/tool_use (trained here first, ~250 SFT steps, unless
--model points at a saved one) on the built-in engine: every trajectory is "call the calculator,
read its output, answer" (2 assistant turns, 1 tool call). `batched` is AgentLoop as the trainer
uses it (one engine call per round for all active trajectories); `sequential` runs the same loop
on one prompt at a time (n samples each), as a per-request agent loop without cross-trajectory
batching would. Runs alternate after one warm-up each; medians are reported, with response
tokens per second and the ratio. Greedy decoding (n slots still decoded per prompt), so both arms
produce the same tokens (checked) and do the same work.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.examples.tool_use import model as tool_model  # noqa: E402
from megarl.parallel.local_ranks import resident_mb  # noqa: E402
from megarl.rollout.base import SamplingParams  # noqa: E402
from megarl.rollout.config import MultiTurnConfig  # noqa: E402
from megarl.rollout.multiturn import AgentLoop, load_tools  # noqa: E402
from megarl.rollout.native import NativeEngine  # noqa: E402


SMOKE = dict(prompts=2, n=2, repeats=1, sft_steps=20)   # --smoke (CI): it runs, not how fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a saved tool-use model directory (default: train one now)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sft-steps", type=int, default=250, help="SFT steps of the model trained here (no --model)")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    torch.set_num_threads(args.threads)
    tok = tool_model.build_tokenizer()
    path = args.model
    if path is None:
        path = tempfile.mkdtemp(prefix="tool_model_")
        model, _ = tool_model.train(tok, steps=args.sft_steps)
        model.save_pretrained(path)
    engine = NativeEngine.from_pretrained(path)
    loop = AgentLoop(engine, tok, load_tools("megarl/examples/tool_use/tools.yaml"), MultiTurnConfig(enable=True))
    problems = [(i % 10, (i * 7) % 10) for i in range(args.prompts)]
    prompts = [tok.encode(tool_model.prompt_text(a, b), add_special_tokens=False) for a, b in problems]
    sp = SamplingParams(n=args.n, max_tokens=64, do_sample=False, eos_token_ids=[tok.eos_token_id])

    def batched():
        return [c.token_ids for g in loop.generate(prompts, sp) for c in g]

    def sequential():
        return [c.token_ids for p in prompts for g in loop.generate([p], sp) for c in g]

    arms = {"batched": batched, "sequential": sequential}
    seconds: dict[str, list[float]] = {k: [] for k in arms}
    tokens = {}
    for name, fn in arms.items():
        tokens[name] = fn()                                   # warm-up
    same = tokens["batched"] == tokens["sequential"]
    generated = sum(map(len, tokens["batched"]))
    for _ in range(args.repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{args.prompts} prompts x n={args.n}, {generated} response tokens (model + tool), "
          f"threads={args.threads}, same tokens in both arms: {same}")
    for name in arms:
        print(f"{name:>10}: median {med[name]:.3f}s  ({generated / med[name]:.0f} tokens/s)  runs {seconds[name]}")
    print(f"batched / sequential speed-up: {med['sequential'] / med['batched']:.2f}x (load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"peak resident MiB: main {resident_mb():.0f} (one process)")


if __name__ == "__main__":
    main()
