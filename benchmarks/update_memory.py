"""Padded vs packed, static vs token-budget micro-batches: time, peak memory and padding ratio of
the actor's compute_log_prob and update_policy, side by side, on a long-tailed length mix.

    python benchmarks/update_memory.py                       # CPU, small default shape (~1 min idle)
    python benchmarks/update_memory.py --vocab 152064        # the 152k-vocabulary memory figure
    python benchmarks/update_memory.py --megarl /work/main   # the same run on another checkout (today's code)
    python benchmarks/update_memory.py --device cuda         # on a GPU machine
    python benchmarks/update_memory.py --smoke               # CI: a tiny shape, one repeat

Lengths: prompts uniform in [prompt/2, prompt], responses geometric with mean `--mean-response`,
5% of them at `--response` (the cap), like GSM8K rollouts with a few runaway answers. One process
(TP = PP = DP = 1). Time: median of `--repeats` after one warm-up. Peak memory (compute_log_prob, and
the update's forward + backward over the whole mini-batch): on CUDA torch.cuda.max_memory_allocated
above the memory held before the call; on CPU the peak of live tensor bytes allocated during the
call, from torch's profiler (profile_memory: each op's own allocations and frees summed in time
order; the model and batch that exist before are not counted). Padding ratio: tokens the model
computed / real tokens (perf/padding_ratio), over one
compute_log_prob and one update_policy.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time

# One process per run (it starts torch.distributed with world size 1): run it as a script.

def peak_alloc_bytes(fn) -> int:
    """Peak bytes of tensors allocated (and not yet freed) while `fn()` runs, on CPU: torch's
    profiler records each op's own allocations and frees; summed in time order they give the live
    total at op granularity (tensors that exist before the call are not counted)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def peak_bytes(fn, device: str) -> int:
    import torch
    if device != "cuda":
        return peak_alloc_bytes(fn)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def make_batch(vocab: int, B: int, P: int, R: int, mean_r: float, seed: int = 0):
    """Right-padded rows; responses geometric (mean `mean_r`), 5% at the cap R."""
    import torch

    from megarl.models.tiny import token_rows
    from megarl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(max(1, P // 2), P + 1, (B,), generator=g)
    u = torch.rand(B, generator=g).clamp(min=1e-12)
    rlen = (torch.log(u) / torch.log(torch.tensor(1 - 1 / mean_r))).long() + 1    # geometric, support >= 1
    capped = torch.randperm(B, generator=g)[:max(1, round(0.05 * B))]
    rlen[capped] = R
    rlen = rlen.clamp(1, R)
    return DataProto.from_dict({**token_rows(plen, rlen, R, vocab, g), "advantages": torch.randn(B, R, generator=g),
                                "old_log_probs": torch.zeros(B, R)})


def loss_fn(out, mb):
    m = mb.batch["response_mask"]
    loss = (-(out["log_probs"] * mb.batch["advantages"]) * m).sum() / mb.meta_info["global_tokens"]
    return loss, {"actor/entropy": float((out["entropy"].detach() * m).sum() / m.sum().clamp(min=1))}


# (name, use_remove_padding, use_dynamic_bsz, offload weights + grads + optimizer state around rollout)
ROWS = [("padded, static", False, False, False), ("padded, dynamic", False, True, False),
        ("packed, static", True, False, False), ("packed, dynamic", True, True, False),
        ("packed, dyn, offload", True, True, True)]


def run_row(path, a, row, data):
    import torch

    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    name, packed, dynamic, offload = row
    extra = {}
    if hasattr(ActorConfig, "use_dynamic_bsz"):
        extra = {"use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": a.max_tokens}
    elif dynamic or packed:
        return None  # a checkout without these keys runs today's layout only
    if offload:
        if not hasattr(MegatronConfig, "optimizer_offload") or not hasattr(ActorWorker, "offload"):
            return None  # a checkout whose offload keys do nothing
        extra["megatron"] = MegatronConfig(param_offload=True, grad_offload=True, optimizer_offload=True)
    cfg = ActorConfig(ppo_mini_batch_size=a.batch, ppo_micro_batch_size_per_gpu=a.micro,
                      optim=OptimConfig(lr=1e-6), **extra)
    state.init_distributed()   # the rank set-up: the engine starts no process group
    if extra:
        actor = ActorWorker(ModelConfig(path=path, use_remove_padding=packed), cfg,
                            log_prob_max_tokens=a.max_tokens if dynamic else None)
    else:
        actor = ActorWorker(ModelConfig(path=path), cfg)
    eng = actor.engine
    if hasattr(eng, "take_padding"):
        eng.take_padding()
    lp = lambda: actor.compute_log_prob(data)  # noqa: E731
    up = lambda: actor.update_policy(data, loss_fn)  # noqa: E731
    lp(), up()  # warm-up; also the padding-ratio sample
    if hasattr(eng, "take_padding"):
        computed, real = eng.take_padding()
    else:  # today's code: every micro-batch right-padded to the batch's longest row, twice (log-prob, update)
        lens = (data.batch["prompt_lens"] + data.batch["response_lens"])
        computed, real = 2 * len(data) * int(lens.max()), 2 * int(lens.sum())
    times = {"lp": [], "up": []}
    for _ in range(a.repeats):
        for key, fn in (("lp", lp), ("up", up)):
            if a.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if a.device == "cuda":
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - t)
    # The update's activation peak: one mini-batch's forward + backward (the optimizer step's
    # temporaries, the same in every row, are left out).
    budget = {"max_tokens": a.max_tokens if dynamic else None} if extra else {}
    fwd_bwd = lambda: eng.accumulate(data, a.micro, actor._process(1.0, True), loss_fn, **budget)  # noqa: E731
    mem = {"lp": peak_bytes(lp, a.device), "up": peak_bytes(fwd_bwd, a.device)}
    # What the trainer holds on the device while the engine would generate: weights, grad buffers
    # and optimizer state, after the handoff the fit loop makes (offload acts on CUDA only: on CPU
    # the device's memory is host memory and the keys say so once).
    held, cycle_s = (eng.resident_bytes() if hasattr(eng, "resident_bytes") else None), None
    if offload:
        t = time.perf_counter()
        actor.offload()
        held = eng.resident_bytes()
        actor.onload()
        cycle_s = time.perf_counter() - t
    # Freed by rebinding, not `del`: the lambdas above read these names, and rebinding frees the
    # model all the same (their cells, which `fn` still holds, now hold None).
    actor = eng = None
    gc.collect()
    from megarl.parallel import state
    state.destroy_model_parallel()
    return {"name": name, "lp_s": statistics.median(times["lp"]), "up_s": statistics.median(times["up"]),
            "lp_mib": mem["lp"] / 2**20, "up_mib": mem["up"] / 2**20, "padding": computed / real,
            "held_mib": None if held is None else held / 2**20, "offload_cycle_s": cycle_s}


# --smoke (CI): a tiny model and batch, one repeat, the first and last rows (padded static; packed,
# token budget and offload: between them every path a row takes)
SMOKE = dict(batch=4, micro=2, prompt=8, response=16, mean_response=6.0, max_tokens=32, vocab=512, hidden=64,
             layers=2, repeats=1, rows="0,4")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--mean-response", type=float, default=40.0)
    p.add_argument("--max-tokens", type=int, default=512, help="token budget of the dynamic rows")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--megarl", default=None, help="import megarl from this checkout (e.g. /work/main: today's code)")
    p.add_argument("--rows", default=None, help="comma-separated row numbers to run (default all)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    sys.path.insert(0, os.path.abspath(a.megarl or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as probe:      # a free port, not a fixed one another run may hold
        probe.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(probe.getsockname()[1]))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import megarl
    from megarl.models.tiny import make_tiny_hf
    print(f"megarl from {os.path.dirname(megarl.__file__)}; device {a.device}")
    rows = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        heads = max(2, a.hidden // 32)
        path = make_tiny_hf(os.path.join(tmp, "model"), "qwen2", vocab_size=a.vocab, hidden_size=a.hidden,
                            intermediate_size=3 * a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads,
                            num_key_value_heads=heads // 2, tokenizer=False)
        data = make_batch(a.vocab, a.batch, a.prompt, a.response, a.mean_response)
        lens = data.batch["prompt_lens"] + data.batch["response_lens"]
        print(f"batch {a.batch} rows, lengths mean {lens.float().mean():.0f}, max {int(lens.max())}; "
              f"vocab {a.vocab}, micro {a.micro} rows or {a.max_tokens} tokens")
        for row in rows:
            r = run_row(path, a, row, data)
            if r is not None:
                results.append(r)
    print(f"{'layout':<21}{'log_prob s':>11}{'update s':>10}{'log_prob MiB':>14}{'fwd+bwd MiB':>12}{'padding':>9}"
          f"{'held in rollout MiB':>21}{'offload+onload s':>18}")
    for r in results:
        held = "-" if r["held_mib"] is None else f"{r['held_mib']:.1f}"
        cycle = "-" if r["offload_cycle_s"] is None else f"{r['offload_cycle_s']:.3f}"
        print(f"{r['name']:<21}{r['lp_s']:>11.3f}{r['up_s']:>10.3f}{r['lp_mib']:>14.1f}{r['up_mib']:>12.1f}"
              f"{r['padding']:>9.3f}{held:>21}{cycle:>18}")
    import resource
    print(f"peak resident MiB: main {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} (one process, "
          f"every row; load average {os.getloadavg()[0]:.1f})")
    if a.device == "cpu" and any(r["offload_cycle_s"] is not None for r in results):
        print("offload acts on CUDA only (on CPU the device's memory is host memory): the offload row shows "
              "what stays held here; run with --device cuda for the saving")
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
