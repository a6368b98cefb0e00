"""Weight sync: megarl's bucketed sync vs a naive full-state-dict sync vs the raw collectives, side by side.

    python benchmarks/weight_sync.py [--repeats 3] [--warmup 1] [--bucket-mb 64] [--layers 6]
    python benchmarks/weight_sync.py --smoke        # CI: a tiny model, one repeat, layouts (1,1) and (2,2)
    python benchmarks/weight_sync.py --delta [--smoke]   # delta vs full after real Adam steps (weight_sync_delta.py)

4 gloo ranks on CPU, a ~136M-parameter Qwen2 model (fp32, ~545 MB), actor layouts (TP, PP) in
(1,1), (2,1), (1,2), (2,2) (DP fills the 4 ranks) to native engines at rollout TP 1 and 2
(colocated: every rank holds an actor shard and an engine shard). The actor is built frozen
(weights only: a sync reads nothing else; see policy_weights). Per pair, in alternation after
`--warmup` rounds, medians of `--repeats`:

  megarl  ColocatedSync: TP gather + PP broadcast in buckets, async overlap, shard fast path.
  naive   every stage's HF tensors (actor.hf_tensors(), TP-gathered tensor by tensor) are sent to
          rank 0, which then holds the full state dict and broadcasts it tensor by tensor; every
          rank loads each tensor into its engine.
  raw     the bytes megarl's plan moves, with no conversion and no engine: per bucket one in-place
          gather over TP (a broadcast per TP rank: gloo's all-gather measured 3-4x slower) and one
          broadcast over PP, into one buffer allocated before timing. The transport's limit.
  floor   raw plus one plain copy of the engine's share of the weights (model / rollout TP) into
          the engine's parameters per rank: what any sync that loads an engine must at least do
          (no engine can load weights it does not write).

Memory per rank at the default shape (M = 545 MB, the model in fp32): the interpreter, torch and
megatron (~0.35 GB), the actor's shard (M / TP / PP, and once M while its checkpoint loads), the
engine's (M / rollout TP), the raw buffer (the largest bucket), and during `naive` rank 0's
full state dict (M) and each sender's copy of its stage; `rank MB` and the last line print it
(figures: docs/measurements.md).

Seconds are the slowest rank's; GB/s is model GB (what every engine replica receives) per
second; peak MB is the largest resident-set growth over ranks during that way
(megarl/checkpoint_engine/memory.py); rank MB the largest rank's whole resident set.
Layouts where megarl moves no bytes (every rank already holds its engine's part) have no raw figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megarl.parallel.local_ranks import run_local  # noqa: E402

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
ROLLOUT_TP = [1, 2]


# --smoke (CI): a tiny model, one repeat, the two layouts that cover every path (direct, TP gather + PP broadcast)
SMOKE = dict(layers=2, hidden=64, vocab=512, repeats=1, warmup=0, bucket_mb=0.05, layouts=[(1, 1), (2, 2)])


def shape(layers: int, hidden: int = 1024, vocab: int = 32000) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8)


# -- the three ways --------------------------------------------------------------------------------------
def naive_sync(actor, engine, sync) -> None:
    """Rank 0 collects the full state dict, then broadcasts it tensor by tensor."""
    import torch.distributed as dist
    lay, rank, plan = actor.engine.layout, dist.get_rank(), sync.plan
    shapes = plan.hf_shapes()
    stage_of = {h: b.stage for b in plan.buckets for e in b.entries for h in plan_hf(plan, e)}
    sender = rank == 0 or (lay.tp_rank == 0 and lay.dp_rank == 0)
    # every rank takes part in the TP all-gather (tensor by tensor); only the senders keep a copy
    mine = {name: t.clone() for name, t in actor.hf_tensors() if sender}
    full = mine if rank == 0 else {}
    if rank == 0:
        for name in shapes:
            if name not in full:
                full[name] = torch.empty(shapes[name])
                dist.recv(full[name], src=sync.src.stage_rank(stage_of[name]))
    elif sender:
        for name in shapes:
            if name in mine:
                dist.send(mine[name], dst=0)
    del mine
    for name in shapes:
        t = full[name] if rank == 0 else torch.empty(shapes[name])
        dist.broadcast(t, src=0)
        engine.update_weights([(name, t)])
    engine.finalize_weights()


def plan_hf(plan, entry) -> list[str]:
    from megarl.models.convert import hf_names
    return hf_names(entry.name, plan.spec, plan.head)


def raw_moves(sync) -> list[tuple[int, int, int]]:
    """Per bucket of megarl's plan: (its stage, elements one TP rank adds to the gather over TP,
    elements broadcast over PP); zeros where that collective does not run."""
    src = sync.src
    return [(b.stage, b.gather_numel if src.tp > 1 else 0, b.numel(src.tp, with_local=True) if src.pp > 1 else 0)
            for b in sync.plan.buckets]


def raw_buffer(sync) -> torch.Tensor | None:
    """One buffer for the largest bucket megarl's plan moves over a collective (None: it moves none),
    allocated before timing and reused bucket after bucket, as megarl reuses its own."""
    size = max((max(sync.src.tp * g, n) for _, g, n in raw_moves(sync)), default=0)
    return torch.empty(size) if size else None


def raw_sync(sync, buf) -> None:
    """megarl's plan with no conversion and no engine: per bucket one in-place gather over TP (a
    broadcast per TP rank: gloo's all-gather measured 3-4x slower) on the bucket's stage, and one
    broadcast over PP."""
    import torch.distributed as dist

    from megarl.checkpoint_engine.colocated import gather_in_place
    src = sync.src
    for stage, G, n in raw_moves(sync):
        if G and stage == src.pp_rank:
            for w in gather_in_place(buf[:src.tp * G], src.tp_rank, src.tp, src.tp_group):
                w.wait()
        if n:
            dist.broadcast(buf[:n], src=src.stage_rank(stage), group=src.pp_group)


def floor_sync(sync, buf, engine) -> None:
    """raw, then one plain copy of the engine's share of the weights into the engine's parameters
    (from the bucket buffer, over and over: the bytes are what counts, the next sync rewrites them)."""
    raw_sync(sync, buf)
    src, n, off = buf.view(-1), buf.numel(), 0
    for p in engine.params.values():
        flat, done = p.data.view(-1), 0
        while done < flat.numel():
            k = min(flat.numel() - done, n - off)
            flat[done:done + k].copy_(src[off:off + k])
            done, off = done + k, (off + k) % n


# -- one rank ---------------------------------------------------------------------------------------------
def policy_weights(path: str, tp: int, pp: int):
    """The policy's megatron shards without gradient buffers or optimizer state: a sync reads the
    weights only, and megatron DDP's fp32 grad buffer alone would add one more model per rank."""
    from megarl.parallel import state
    from megarl.workers.actor import engine_spec
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig
    from megarl.workers.engine import EngineShardView, MegatronEngine

    class Weights(EngineShardView):
        def __init__(self):
            state.init_distributed()   # the rank set-up: the engine starts no process group
            self.engine = MegatronEngine(engine_spec(
                ModelConfig(path=path), ActorConfig(megatron=MegatronConfig(tensor_model_parallel_size=tp,
                                                                            pipeline_model_parallel_size=pp)),
                trainable=False, role="actor_rollout_ref.actor"))

        def hf_tensors(self):
            return self.engine.hf_tensors()
    return Weights()


def release() -> None:
    """Give a dropped layout's memory back before the next one: megatron's modules hold reference
    cycles (freed only by a collection), and glibc keeps freed small tensors in its heap."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_rank(rank, world, path, a):
    import torch.distributed as dist

    from megarl.checkpoint_engine.colocated import ColocatedSync
    from megarl.checkpoint_engine.memory import PeakMemory
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.parallel import state
    from megarl.models.hf_config import read_hf_config
    from megarl.parallel.local_ranks import resident_mb
    from megarl.rollout.native import NativeEngine, TPComm

    results = {}
    for tp, pp in a.layouts:
        actor = policy_weights(path, tp, pp)
        for rtp in a.rollout_tp:
            group = None
            for first in range(0, world, rtp):
                g = dist.new_group(list(range(first, first + rtp))) if rtp > 1 else None
                group = g if first <= rank < first + rtp else group
            engine = NativeEngine(read_hf_config(path), comm=TPComm(group))
            sync = ColocatedSync(ShardSource.from_actor(actor), engine, bucket_bytes=int(a.bucket_mb * 2**20))
            buf = raw_buffer(sync)
            has_raw = buf is not None
            ways = {"megarl": sync.sync, "naive": lambda: naive_sync(actor, engine, sync),
                    "raw": lambda: raw_sync(sync, buf), "floor": lambda: floor_sync(sync, buf, engine)}
            times = {k: [] for k in ways}
            peaks = {k: [] for k in ways}
            resident = 0.0                 # this rank's whole resident set at its peak, MiB
            for i in range(a.warmup + a.repeats):
                for way, fn in ways.items():
                    if way in ("raw", "floor") and not has_raw:
                        continue
                    dist.barrier()
                    before = resident_mb(rss_only=True)
                    start = time.perf_counter()
                    with PeakMemory() as mem:
                        fn()
                    dist.barrier()
                    resident = max(resident, before + max(mem.extra_mb, 0), resident_mb())
                    if i >= a.warmup:
                        times[way].append(time.perf_counter() - start)
                        peaks[way].append(mem.extra_mb)
            wire = 4 * sum(sync.src.tp * g + n for _, g, n in raw_moves(sync))
            results[(tp, pp, rtp)] = dict(times=times, peaks=peaks, model=sync.plan.numel() * 4,
                                          buckets=len(sync.plan.buckets), wire=wire, resident=resident,
                                          gathered=sum(e.gather for b in sync.plan.buckets for e in b.entries))
            # Freed by rebinding, not `del`: ways' lambdas read these names, and rebinding frees the
            # parts all the same (their cells, which `fn` still holds, now hold None).
            engine = sync = buf = None
            del ways
            release()
        actor = None  # rebinding, not `del`: the "naive" closure reads the name
        state.destroy_model_parallel()
        release()
    # as (key, value) pairs: the ranks' results come back as plain data (megarl.storage.plain_state), whose
    # mappings take string or integer keys only
    return [[list(key), value] for key, value in results.items()]


def delta_main(a) -> None:
    import weight_sync_delta as wd
    from megarl.models.tiny import make_tiny_hf
    from megarl.rollout.config import codec_problem
    if a.zstd and codec_problem("zstd"):
        print(f"weight_sync --delta: skipping the delta+zstd way ({codec_problem('zstd')})", flush=True)
        a.zstd = False
    if a.results_dir:
        # Ranks started by torchrun, on several nodes: each runs its part; the caller reports.
        from megarl.storage.plain_state import save_plain
        rank = int(os.environ["RANK"])
        save_plain({"result": wd.run_rank(rank, int(os.environ["WORLD_SIZE"]), a.model_dir, a)},
                   os.path.join(a.results_dir, f"rank{rank}.pt"))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_dir or os.path.join(tmp, "model")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_hf(path, "qwen2", tokenizer=False, **shape(a.layers, a.hidden, a.vocab))
        started = time.perf_counter()
        got = run_local(WORLD, wd.run_rank, (path, a))
    print(f"delta weight sync: Qwen2 {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; trainers fp32 + Adam, "
          f"engines bf16; {WORLD} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}); "
          f"bucket {a.bucket_mb:g} MiB; {a.steps} steps per lr; medians over steps 2..{a.steps}, step 0 the "
          f"anchor ({time.perf_counter() - started:.0f} s)")
    wd.report(list(got), a)
    print("avg: one anchor + K - 1 steady deltas, K = --anchor-every. x: full / way (bytes on the wire: the largest "
          "rank's; seconds: the slowest rank's wall time).")
    print("peak resident MiB per rank (whole run, sampled by the parent): "
          + ", ".join(f"rank {r} {mb:.0f}" for r, mb in enumerate(got.peak_mb)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--smoke", action="store_true", help=f"CI's tiny shape, one repeat: {SMOKE}")
    ap.add_argument("--model-dir", default=None, help="where to build (or find) the random HF model")
    ap.add_argument("--delta", action="store_true", help="delta vs full sync after Adam steps "
                    "(benchmarks/weight_sync_delta.py): distributed and disk transports, bf16 engines")
    ap.add_argument("--steps", type=int, default=6, help="--delta: Adam steps per learning rate")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="--delta: learning rates")
    ap.add_argument("--anchor-every", type=int, default=20, help="--delta: a full sync every K (in the averages)")
    ap.add_argument("--no-zstd", dest="zstd", action="store_false", help="--delta: skip the delta+zstd way")
    ap.add_argument("--no-disk", dest="disk", action="store_false", help="--delta: skip the disk transport")
    ap.add_argument("--results-dir", default=None,
                    help="--delta under torchrun (benchmarks/weight_sync_link.py): each rank writes its results here")
    a = ap.parse_args()
    a.layouts, a.rollout_tp = LAYOUTS, ROLLOUT_TP
    a.lrs = [float(x) for x in a.lrs.split(",")]
    if a.smoke:
        vars(a).update(SMOKE)
        if a.delta:
            vars(a).update(steps=3, lrs=[1e-5], anchor_every=4)
    if a.delta:
        return delta_main(a)
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_dir or os.path.join(tmp, "model")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_hf(path, "qwen2", tokenizer=False, **shape(a.layers, a.hidden, a.vocab))
        started = time.perf_counter()
        got = run_local(WORLD, run_rank, (path, a))
    ranks = [{tuple(key): value for key, value in pairs} for pairs in got]
    params = ranks[0][(1, 1, 1)]["model"] / 4
    print(f"model: Qwen2, {params / 1e6:.1f}M parameters, fp32 ({params * 4 / 1e9:.2f} GB); {WORLD} gloo ranks on "
          f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}); bucket {a.bucket_mb:g} MiB; medians "
          f"of {a.repeats} after {a.warmup} warm-up round(s), the ways alternated "
          f"({time.perf_counter() - started:.0f} s)")
    head = (f"{'train (TP,PP) -> rollout TP':<28} {'megarl s':>9} {'GB/s':>6} {'peak MB':>8} | {'naive s':>8} "
            f"{'GB/s':>6} {'peak MB':>8} | {'raw s':>6} {'floor s':>7} {'wire GB':>7} | {'x naive':>7} {'% raw':>6} "
            f"{'% floor':>7} | {'rank MB':>7}")
    print(head)
    print("-" * len(head))
    for key in ranks[0]:
        r0 = ranks[0][key]
        med = {w: statistics.median(max(r[key]["times"][w][i] for r in ranks) for i in range(len(r0["times"][w])))
               if r0["times"][w] else None for w in r0["times"]}
        peak = {w: max(max(r[key]["peaks"][w]) for r in ranks) if r0["peaks"][w] else None for w in r0["peaks"]}
        gb = r0["model"] / 1e9
        if med["raw"]:
            raw = f"{med['raw']:>6.3f} {med['floor']:>7.3f} {r0['wire'] / 1e9:>7.2f}"
            share = f"{100 * med['raw'] / med['megarl']:>5.0f}% {100 * med['floor'] / med['megarl']:>6.0f}%"
        else:
            raw, share = f"{'-':>6} {'-':>7} {0:>7.2f}", f"{'-':>6} {'-':>7}"
        print(f"({key[0]},{key[1]}) -> {key[2]:<19} {med['megarl']:>9.3f} {gb / med['megarl']:>6.2f} "
              f"{peak['megarl']:>8.0f} | {med['naive']:>8.3f} {gb / med['naive']:>6.2f} {peak['naive']:>8.0f} | "
              f"{raw} | {med['naive'] / med['megarl']:>6.1f}x {share} | {max(r[key]['resident'] for r in ranks):>7.0f}")
    print("x naive: naive s / megarl s. % raw: raw s / megarl s, the share of the raw collectives' bandwidth megarl "
          "reaches on the same bytes. % floor: the same against raw + one copy of the engine's weights. rank MB: the "
          "largest rank's whole resident set during that pair.")
    print("peak resident MiB per rank (whole run, sampled by the parent): "
          + ", ".join(f"rank {r} {mb:.0f}" for r, mb in enumerate(got.peak_mb)))


if __name__ == "__main__":
    main()
