"""Rollout throughput: the built-in engine vs transformers' generate, side by side in one run.

    python benchmarks/rollout_throughput.py                      # CPU, defaults below
    python benchmarks/rollout_throughput.py --device cuda --dtype bfloat16
    python benchmarks/rollout_throughput.py --device cuda --dtype bfloat16 --layers 24 --hidden 1024 \
        --vocab-size 32000 --prompts 64 --n 8 --max-tokens 256      # the GPU shape
    python benchmarks/rollout_throughput.py --shape quickstart      # seconds per generate, quickstart shape
    python benchmarks/rollout_throughput.py --smoke --model-dir /tmp/toy_smoke   # CI: tiny model, one repeat

Same ~20M-parameter Qwen2-style model (random init, local BPE tokenizer: benchmarks/toy_model.py),
same prompts (16 text snippets of 16..96 tokens), n=4 samples each, up to 128 new tokens,
temperature 1, same thread count. Runs alternate (native, hf, native, hf, ...) after one
warm-up each; the medians are reported. Tokens/s counts generated tokens (stop token included).

Wall-clock tokens/s is the figure; tokens per CPU-second (process time, all threads) is printed
beside it because on a shared machine other jobs steal wall time. Three engines: `native`
(megarl's engine, with log-probs), `hf` (transformers' generate through the same contract, with
log-probs from the raw logits: what rollout.name=hf does), and `hf-plain` (bare model.generate
without any log-probs, less work than the other two); `vllm` joins where vllm imports, through
megarl's adapter (rollout.name=vllm, megarl/rollout/vllm/: same prompts, n, lengths, stop ids,
seed and log-probs as the other engines; its rows, stops and log-probs are checked once against
transformers before timing, see benchmarks/vllm_peer.py). On CUDA the native engine's generate is also
profiled once: the share of wall time the GPU spends in kernels.

vLLM on CPU installs as the README's "Using vLLM" says (the test command installs it too). It runs
in-process and eagerly, with --threads torch threads, a KV cache sized to the rows, start-up output
in a temp log. Its CPU attention needs head sizes of 64 or more (pick --hidden/--heads to match).

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
from benchmarks.vllm_peer import vllm_runner  # noqa: E402
from megarl.parallel.local_ranks import resident_mb  # noqa: E402
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


def cpu_seconds() -> float:
    """CPU time of this process and its live child processes, all threads."""
    import psutil
    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def gpu_kernel_share(fn) -> tuple[float, float]:
    """(share of wall time with a GPU kernel or copy running, wall seconds) over one call of fn,
    from torch.profiler's device events (the union of their intervals, so overlapping kernels
    count once). The profiler's own overhead lengthens the wall time a little: a lower bound."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for s, e in spans:                                        # union of [start, end) in microseconds
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e6 / wall, wall


def load_baseline(root: str):
    """NativeEngine from another megarl checkout at `root` (e.g. an older commit unpacked with
    `git archive <commit> megarl | tar -x -C <root>`), imported beside this one so both run in
    one process, alternated, under the same machine load. The rest of megarl is this checkout's."""
    import importlib

    import megarl.rollout as pkg
    mine = {k: v for k, v in sys.modules.items() if k.startswith("megarl.rollout.native")}
    for k in mine:
        del sys.modules[k]
    path = list(pkg.__path__)
    pkg.__path__[:] = [os.path.join(root, "megarl", "rollout")]
    try:
        cls = importlib.import_module("megarl.rollout.native.engine").NativeEngine
    finally:
        pkg.__path__[:] = path
        for k in [k for k in sys.modules if k.startswith("megarl.rollout.native")]:
            del sys.modules[k]
        sys.modules.update(mine)
    return cls


def quickstart_step(args) -> dict:
    """The quickstart's shape (configs/quickstart.yaml): the 0.4M-parameter addition model, 32
    prompts "a+b=" x n=8 = 256 rows, at most 8 new tokens, stop on EOS. The figure is seconds per
    generate() call, i.e. the rollout's fixed cost per training step; a random model rarely picks
    EOS, so most rows run the full 8 tokens (the worst case of the trained model)."""
    import random

    from megarl.examples.addition.model import build_model, build_tokenizer
    tok = build_tokenizer()
    os.makedirs(args.model_dir, exist_ok=True)
    build_model(tok, seed=0).save_pretrained(args.model_dir)
    n_params = sum(p.numel() for p in build_model(tok, seed=0).parameters())
    rng = random.Random(0)
    prompts = [tok(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=")["input_ids"] for _ in range(32)]
    native = NativeEngine.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype, sleep_level=2)
    hf = HFEngine(args.model_dir, device=args.device, dtype=args.dtype, pad_token_id=tok.pad_token_id)
    sp = SamplingParams(n=8, max_tokens=8, temperature=1.0, seed=0, eos_token_ids=[tok.eos_token_id])
    state = [(k, v.detach().clone()) for k, v in build_model(tok, seed=0).named_parameters()]

    def step(engine):
        """--sleep-cycle: what the trainer does per step around generate (free_cache_engine with
        load_format=dummy): wake, the weight sync, generate, sleep (level 2: drop the weights)."""
        if not args.sleep_cycle:
            return engine.generate(prompts, sp)
        engine.wake()
        engine.update_weights(state)
        engine.finalize_weights()
        out = engine.generate(prompts, sp)
        engine.sleep()
        return out
    runs = {"native": lambda: step(native), "hf": lambda: hf.generate(prompts, sp)}
    if args.baseline:
        base = load_baseline(args.baseline).from_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                                                            sleep_level=2)
        runs["baseline"] = lambda: step(base)
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()                                                  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():                         # alternate, so drift hits all alike
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"quickstart shape: {n_params / 1e6:.2f}M params, {args.device} {args.dtype}, {args.threads} threads; "
          f"32 prompts x n=8 = 256 rows, max 8 new tokens, {args.repeats} timed runs each"
          + ("; native engines timed over wake + weight sync + generate + sleep" if args.sleep_cycle else ""))
    for k, v in times.items():
        print(f"  {k:9s} {med[k]:.4f} s per generate (median; runs {', '.join(f'{x:.3f}' for x in v)}; "
              f"{statistics.median(cpu[k]):.4f} CPU-seconds, all threads)")
    for k in [k for k in runs if k != "native"]:
        print(f"  ratio {k} / native = {med[k] / med['native']:.2f}x seconds per generate")
    return med


# --smoke (CI, and gpu_check --dry-run): a tiny model, a few short rows, one timed run
# vLLM stays out of the smoke run (its start-up alone is a minute); tests/rollout/vllm_checks.py
# runs this benchmark's vLLM peer.
SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=512, prompts=2, n=2, max_tokens=8,
             shortest=4, longest=8, repeats=1, vllm=False)


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
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="add vLLM as a peer where it imports (--no-vllm: skip)")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="native engine slots (memory budget permitting)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="native: no CUDA graphs (vllm always runs eagerly through megarl's adapter)")
    ap.add_argument("--static", action="store_true",
                    help="native on CPU: run the padded static-shape path CUDA graphs replay (eagerly), "
                         "to count its shapes")
    ap.add_argument("--sleep-cycle", action="store_true",
                    help="quickstart shape: time wake + weight sync + generate + sleep, as the trainer runs them")
    ap.add_argument("--baseline", default=None,
                    help="a megarl checkout whose native engine runs beside this one (load_baseline)")
    ap.add_argument("--layers", type=int, default=10, help="model depth (only when the model is built)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6, help="attention heads (only when the model is built)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer size (only when it is built)")
    ap.add_argument("--shape", choices=["default", "quickstart"], default="default",
                    help="quickstart: seconds per generate at configs/quickstart.yaml's shape instead")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)

    torch.set_num_threads(args.threads)
    if args.shape == "quickstart":
        return quickstart_step(args)
    tok, n_params = build(args.model_dir, args.vocab_size, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, intermediate=args.intermediate)
    prompts = make_prompts(tok, args.prompts, args.shortest, args.longest)
    native = NativeEngine.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                                          max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    native.decode.static = native.decode.static or args.static
    hf = HFEngine(args.model_dir, device=args.device, dtype=args.dtype, pad_token_id=tok.pad_token_id)
    sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                        stop_token_ids=stop_ids(tok, args.stop_fraction))
    base = (load_baseline(args.baseline).from_pretrained(args.model_dir, device=args.device, dtype=args.dtype)
            if args.baseline else None)

    def timed(fn) -> tuple[float, float, int]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t, c = time.perf_counter(), cpu_seconds()
        tokens = fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t, cpu_seconds() - c, tokens

    def count(groups):
        return sum(len(c.token_ids) for g in groups for c in g)

    runs = {"native": lambda: count(native.generate(prompts, sp)),
            "hf": lambda: count(hf.generate(prompts, sp))}
    if base is not None:
        runs["baseline"] = lambda: count(base.generate(prompts, sp))
    if not args.no_plain:
        runs["hf-plain"] = lambda: hf_plain(hf, prompts, sp)
    if args.vllm:
        vllm = vllm_runner(args, prompts, sp, reference=hf.model)
        if vllm is not None:
            runs["vllm"] = vllm
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
    print(f"  peak resident memory: {resident_mb():.0f} MiB (this one process, every engine in it; load average "
          f"{os.getloadavg()[0]:.1f})")
    c = native.cache                      # the n samples of a prompt share its K/V (kv_cache.py)
    copies = c.bytes_per_token() * c.rows * (c.prompt_len + c.gen_len)
    print(f"  native: KV cache {c.nbytes() / 2**20:.1f} MiB for {c.rows} rows and {c.groups} prompt groups "
          f"({copies / 2**20:.1f} MiB if every sample held its own copy of its prompt)")
    if native.decode.static:
        print(f"  native: {len(native.decode.shapes)} distinct decode-step shapes (one CUDA graph each) over "
              f"{native.stats['decode_steps']} steps of {args.repeats + 1} generate calls")
    if args.device.startswith("cuda"):
        share, wall = gpu_kernel_share(runs["native"])
        print(f"  native: GPU kernels busy {100 * share:.1f}% of wall time during one generate "
              f"({wall:.2f} s under torch.profiler); CUDA graphs {native.decode.stats}")
    return med


if __name__ == "__main__":
    main()
