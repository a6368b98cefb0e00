"""Rollout throughput: the built-in engine vs transformers' generate, side by side in one run.

    python benchmarks/rollout_throughput.py                      # CPU, defaults below
    python benchmarks/rollout_throughput.py --device cuda --dtype bfloat16

Same ~20M-parameter Qwen2-style model (random init, local BPE tokenizer: benchmarks/toy_model.py),
same prompts (16 text snippets of 16..96 tokens), n=4 samples each, up to 128 new tokens,
temperature 1, same thread count. Runs alternate (native, hf, native, hf, ...) after one
warm-up each; the medians are reported. Tokens/s counts generated tokens (stop token included).

Wall-clock tokens/s is the figure; tokens per CPU-second (process time, all threads) is printed
beside it because on a shared machine other jobs steal wall time. Three engines: `native`
(megarl's engine, with log-probs), `hf` (transformers' generate through the same contract, with
log-probs from the raw logits: what rollout.name=hf does), and `hf-plain` (bare model.generate
without any log-probs, less work than the other two).

Response lengths: a randomly initialised model spreads its probability evenly, so it would
almost never pick the one EOS id. The run therefore stops on EOS plus a fixed random 1/64 of
the vocabulary (`--stop-fraction`), which gives geometric lengths of mean ~64 tokens, 13% cut
at the 128 limit: the mix of short and long answers a policy produces in RL rollouts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# OpenMP threads that spin while waiting stall whenever another job holds a core (a 2-thread run
# on a shared 2-core machine ran 5x slower for both engines); sleeping waits avoid that. Set
# before torch loads its OpenMP runtime; OMP_WAIT_POLICY=ACTIVE in the environment overrides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.toy_model import build, corpus  # noqa: E402
from megarl.rollout.base import SamplingParams  # noqa: E402
from megarl.rollout.hf import HFEngine  # noqa: E402
from megarl.rollout.native import NativeEngine  # noqa: E402


def make_prompts(tok, count: int, shortest: int, longest: int) -> list[list[int]]:
    text = "\n".join(corpus(40))
    ids = tok(text)["input_ids"]
    lengths = [round(shortest + (longest - shortest) * i / max(count - 1, 1)) for i in range(count)]
    step = (len(ids) - longest) // count
    return [ids[i * step: i * step + n] for i, n in enumerate(lengths)]


def stop_ids(tok, fraction: float) -> list[int]:
    g = torch.Generator().manual_seed(0)
    k = max(1, round(fraction * len(tok)))
    extra = [t for t in torch.randperm(len(tok), generator=g).tolist() if t != tok.eos_token_id][:k - 1]
    return [tok.eos_token_id] + extra


def hf_plain(engine: HFEngine, prompts, sp: SamplingParams) -> int:
    """Bare model.generate (no log-probs); the same batch layout as the hf engine."""
    from transformers import GenerationConfig
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    cfg = GenerationConfig(do_sample=True, temperature=sp.temperature, top_k=0, top_p=1.0,
                           max_new_tokens=sp.max_tokens, num_return_sequences=sp.n,
                           eos_token_id=sorted(sp.stop_ids), pad_token_id=engine.pad_token_id)
    torch.manual_seed(sp.seed)
    out = engine.model.generate(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                                generation_config=cfg)[:, P:].tolist()
    stops = sp.stop_ids
    return sum(next((k + 1 for k, t in enumerate(r) if t in stops), len(r)) for r in out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/megarl_toy_bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--shortest", type=int, default=16)
    ap.add_argument("--longest", type=int, default=96)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--stop-fraction", type=float, default=1 / 64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-plain", action="store_true", help="skip the bare model.generate figure")
    ap.add_argument("--layers", type=int, default=10, help="model depth (only when the model is built)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6, help="attention heads (only when the model is built)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer size (only when it is built)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok, n_params = build(args.model_dir, args.vocab_size, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, intermediate=args.intermediate)
    prompts = make_prompts(tok, args.prompts, args.shortest, args.longest)
    native = NativeEngine.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype)
    hf = HFEngine(args.model_dir, device=args.device, dtype=args.dtype, pad_token_id=tok.pad_token_id)
    sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                        stop_token_ids=stop_ids(tok, args.stop_fraction))

    def timed(fn) -> tuple[float, float, int]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        tokens = fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t, time.process_time() - c, tokens

    def count(groups):
        return sum(len(c.token_ids) for g in groups for c in g)

    runs = {"native": lambda: count(native.generate(prompts, sp)),
            "hf": lambda: count(hf.generate(prompts, sp))}
    if not args.no_plain:
        runs["hf-plain"] = lambda: hf_plain(hf, prompts, sp)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    cpu_rates: dict[str, list[float]] = {k: [] for k in runs}
    lengths: dict[str, list[int]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()                                                  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():                         # alternate, so drift hits all alike
            wall, cpu, tokens = timed(fn)
            rates[name].append(tokens / wall)
            cpu_rates[name].append(tokens / cpu)
            lengths[name].append(tokens)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    rows = args.prompts * args.n
    print(f"model {n_params / 1e6:.1f}M params, {args.device} {args.dtype}, {args.threads} threads "
          f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          f"{args.prompts} prompts ({args.shortest}..{args.longest} tokens) x n={args.n}, "
          f"max {args.max_tokens} new tokens, T={args.temperature}, {args.repeats} timed runs each")
    for k in runs:
        print(f"  {k:9s} {med[k]:9.1f} tokens/s (median; runs {', '.join(f'{r:.0f}' for r in rates[k])}; "
              f"{cpu_med[k]:.1f} tokens per CPU-second; mean response {statistics.mean(lengths[k]) / rows:.1f} tokens)")
    for other in [k for k in runs if k != "native"]:
        print(f"  ratio native / {other:8s} = {med['native'] / med[other]:.2f}x tokens/s "
              f"({cpu_med['native'] / cpu_med[other]:.2f}x per CPU-second)")
    return med


if __name__ == "__main__":
    main()
