"""Weight sync: megarl's bucketed sync vs a naive full-state-dict sync vs the raw collectives, side by side.

    python benchmarks/weight_sync.py [--repeats 3] [--warmup 1] [--bucket-mb 64] [--layers 6]

4 gloo ranks on CPU, a ~136M-parameter Qwen2 model (fp32, ~545 MB), actor layouts (TP, PP) in
(1,1), (2,1), (1,2), (2,2) (DP fills the 4 ranks) to native engines at rollout TP 1 and 2
(colocated: every rank holds an actor shard and an engine shard). Per pair, in alternation after
`--warmup` rounds, medians of `--repeats`:

  megarl  ColocatedSync: TP gather + PP broadcast in buckets, async overlap, shard fast path.
  naive   every stage's HF tensors (actor.hf_tensors(), TP-gathered tensor by tensor) are sent to
          rank 0, which then holds the full state dict and broadcasts it tensor by tensor; every
          rank loads each tensor into its engine.
  raw     the bytes megarl's plan moves, with no conversion and no engine: per stage one in-place
          gather over TP (a broadcast per TP rank: gloo's all-gather measured 3-4x slower) and one
          broadcast over PP, into buffers allocated before timing. The transport's limit.
  floor   raw plus one plain copy of the engine's share of the weights (model / rollout TP) per
          rank: what any sync that loads an engine must at least do (no engine can load weights
          it does not write).

Seconds are the slowest rank's; GB/s is model GB (what every engine replica receives) per
second; peak MB is the largest resident-set growth over ranks (megarl/checkpoint_engine/memory.py).
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


def shape(layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8)


# -- the three ways --------------------------------------------------------------------------------------
def naive_sync(actor, engine, sync) -> None:
    """Rank 0 collects the full state dict, then broadcasts it tensor by tensor."""
    import torch.distributed as dist
    lay, rank, plan = actor.engine.layout, dist.get_rank(), sync.plan
    shapes = plan.hf_shapes()
    stage_of = {h: b.stage for b in plan.buckets for e in b.entries for h in plan_hf(plan, e)}
    mine = {name: t.clone() for name, t in actor.hf_tensors()}   # TP all-gather, tensor by tensor
    full = mine if rank == 0 else {}
    if rank == 0:
        for name in shapes:
            if name not in full:
                full[name] = torch.empty(shapes[name])
                dist.recv(full[name], src=sync.src.stage_rank(stage_of[name]))
    elif lay.tp_rank == 0 and lay.dp_rank == 0:
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


def raw_buffers(sync):
    """Per stage: (gathered elements per TP rank, elements broadcast over PP), as megarl's plan moves them."""
    src, plan = sync.src, sync.plan
    out = []
    for p in range(src.pp):
        bs = [b for b in plan.buckets if b.stage == p]
        gathered = sum(b.gather_numel for b in bs) if src.tp > 1 else 0
        broadcast = sum(b.numel(src.tp, with_local=True) for b in bs) if src.pp > 1 else 0
        out.append((torch.empty(src.tp * gathered) if gathered else None, torch.empty(broadcast) if broadcast else None))
    return out


def floor_sync(sync, buffers, scratch) -> None:
    raw_sync(sync, buffers)
    scratch[1].copy_(scratch[0])


def raw_sync(sync, buffers) -> None:
    import torch.distributed as dist

    from megarl.checkpoint_engine.colocated import gather_in_place
    src = sync.src
    for p, (gbuf, bbuf) in enumerate(buffers):
        if gbuf is not None and p == src.pp_rank:
            for w in gather_in_place(gbuf, src.tp_rank, src.tp, src.tp_group):
                w.wait()
        if bbuf is not None:
            dist.broadcast(bbuf, src=src.stage_rank(p), group=src.pp_group)


# -- one rank ---------------------------------------------------------------------------------------------
def run_rank(rank, world, path, a):
    import torch.distributed as dist

    from megarl.checkpoint_engine.colocated import ColocatedSync
    from megarl.checkpoint_engine.memory import PeakMemory
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.parallel import state
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.native import NativeEngine, TPComm
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig

    results = {}
    for tp, pp in LAYOUTS:
        actor = ActorWorker(ModelConfig(path=path), ActorConfig(
            ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
            megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)))
        for rtp in ROLLOUT_TP:
            group = None
            for first in range(0, world, rtp):
                g = dist.new_group(list(range(first, first + rtp))) if rtp > 1 else None
                group = g if first <= rank < first + rtp else group
            engine = NativeEngine(read_hf_config(path), comm=TPComm(group))
            sync = ColocatedSync(ShardSource.from_actor(actor), engine, bucket_bytes=int(a.bucket_mb * 2**20))
            buffers = raw_buffers(sync)
            has_raw = any(g is not None or b is not None for g, b in buffers)
            share = sync.plan.numel() // rtp
            scratch = (torch.ones(share), torch.zeros(share))
            ways = {"megarl": sync.sync, "naive": lambda: naive_sync(actor, engine, sync),
                    "raw": lambda: raw_sync(sync, buffers), "floor": lambda: floor_sync(sync, buffers, scratch)}
            times = {k: [] for k in ways}
            peaks = {k: [] for k in ways}
            for i in range(a.warmup + a.repeats):
                for way, fn in ways.items():
                    if way in ("raw", "floor") and not has_raw:
                        continue
                    dist.barrier()
                    start = time.perf_counter()
                    with PeakMemory() as mem:
                        fn()
                    dist.barrier()
                    if i >= a.warmup:
                        times[way].append(time.perf_counter() - start)
                        peaks[way].append(mem.extra_mb)
            wire = sum((g.numel() if g is not None else 0) + (b.numel() if b is not None else 0)
                       for g, b in buffers) * 4
            results[(tp, pp, rtp)] = dict(times=times, peaks=peaks, model=sync.plan.numel() * 4,
                                          buckets=len(sync.plan.buckets), wire=wire,
                                          gathered=sum(e.gather for b in sync.plan.buckets for e in b.entries))
            del engine, sync, buffers, scratch
        del actor
        state.destroy_model_parallel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--model-dir", default=None, help="where to build (or find) the random HF model")
    a = ap.parse_args()
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_dir or os.path.join(tmp, "model")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_hf(path, "qwen2", tokenizer=False, **shape(a.layers))
        started = time.perf_counter()
        ranks = run_local(WORLD, run_rank, (path, a))
    params = ranks[0][(1, 1, 1)]["model"] / 4
    print(f"model: Qwen2, {params / 1e6:.0f}M parameters, fp32 ({params * 4 / 1e9:.2f} GB); {WORLD} gloo ranks on "
          f"{os.cpu_count()} CPU cores; bucket {a.bucket_mb:g} MiB; medians of {a.repeats} after {a.warmup} warm-up "
          f"round(s), the three ways alternated ({time.perf_counter() - started:.0f} s)")
    head = (f"{'train (TP,PP) -> rollout TP':<28} {'megarl s':>9} {'GB/s':>6} {'peak MB':>8} | {'naive s':>8} "
            f"{'GB/s':>6} {'peak MB':>8} | {'raw s':>6} {'floor s':>7} {'wire GB':>7} | {'x naive':>7} {'% raw':>6} "
            f"{'% floor':>7}")
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
              f"{raw} | {med['naive'] / med['megarl']:>6.1f}x {share}")
    print("x naive: naive s / megarl s. % raw: raw s / megarl s, the share of the raw collectives' bandwidth megarl "
          "reaches on the same bytes. % floor: the same against raw + one copy of the engine's weights.")


if __name__ == "__main__":
    main()
