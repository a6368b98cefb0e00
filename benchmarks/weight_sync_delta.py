"""Delta vs full weight sync after real Adam steps (run through weight_sync.py):

    python benchmarks/weight_sync.py --delta [--steps 6] [--lrs 1e-6,1e-5] [--layers 6]
    python benchmarks/weight_sync.py --delta --smoke        # CI: a tiny model, 3 steps

4 gloo ranks on CPU: ranks 0-1 train, ranks 2-3 run bf16 native engines (the distributed
transport, rollout.placement=disaggregated). Both trainer ranks train the same transformers Qwen2
model (136M parameters at the default shape, fp32, torch.optim.Adam, real gradients of the LM loss
on a fixed random batch, one thread each: identical weights without communication) and cut their
megatron shards from it (convert.hf_to_megatron) after every step. Per step and per layout
(trainer TP 2 -> two engines at rollout TP 1; trainer PP 2 -> one engine at rollout TP 2), in
alternation: `full` (a full sync in bf16, the transport's normal path) into one engine, `delta`
(delta mode, K = --anchor-every) into a second, and on the first layout `delta+zstd` into a third;
after each step every delta engine's bits are compared with the full one's.

The disk transport runs on trainer rank 0 alone after the same steps (TP 1 shards, one
directory per way): full HF exports vs delta exports (megarl/checkpoint_engine/disk_delta.py),
each read back (read_weights) and compared with the full export's tensors bit for bit.

Printed per lr: the fraction of bf16 elements that changed per step; per layout and way: median
seconds and bytes of the steady delta syncs, the anchor's (the first sync), and the average over a
K-sync cycle (one anchor + K - 1 deltas: anchors included), with the ratios to full.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

TRAINERS, ENGINES = [0, 1], [2, 3]
LAYOUTS = [(2, 1, 1), (1, 2, 2)]
BF16 = torch.bfloat16


def shards(full: dict, spec, tp: int, pp: int, t: int, p: int) -> dict:
    from megarl.checkpoint_engine.plan import stage_names
    from megarl.models.convert import hf_to_megatron
    return {n: hf_to_megatron(n, full, spec, t, tp) for n in stage_names(spec, pp, p)}


class Trainer:
    """A transformers model, Adam, one fixed batch: step() is one real optimizer step."""

    def __init__(self, path: str, lr: float, seed: int = 0):
        from transformers import AutoModelForCausalLM
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=g)

    def step(self) -> None:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def hf(self) -> dict:
        return {n: p.detach() for n, p in self.model.state_dict().items() if not n.endswith("inv_freq")}


def same_bits(a, b) -> bool:
    return all(torch.equal(pa.data.view(torch.int16), pb.data.view(torch.int16))
               for pa, pb in zip(a.params.values(), b.params.values()))


def ways(a) -> list[str]:
    """The ways compared; delta+zstd only where asked and zstandard imports (weight_sync.py says so once)."""
    return ["full", "delta", "delta+zstd"] if a.zstd else ["full", "delta"]


def run_rank(rank, world, path, a):
    import torch.distributed as dist

    from megarl.checkpoint_engine.delta_sync import DeltaOptions
    from megarl.checkpoint_engine.distributed import DisaggregatedGroups, DisaggregatedReceiver, DisaggregatedSender
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.models.hf_config import read_hf_config
    from megarl.parallel.bridge import Bridge, job_store
    from megarl.rollout.native import NativeEngine, TPComm

    store, _, _ = job_store(600)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world)
    everyone = Bridge(store, "world", range(world), rank)
    spec = HFCheckpoint(path).spec()
    bucket = int(a.bucket_mb * 2**20)
    engine_group = dist.new_group(ENGINES)
    solo = dist.new_group([0])           # the disk run: trainer rank 0 alone
    results = []
    for lr in a.lrs:
        trainer = Trainer(path, lr) if rank in TRAINERS else None
        sides = {}                        # (layout, way) -> sender or receiver (and its engine)
        for tp, pp, rtp in LAYOUTS:
            for way in ways(a) if (tp, pp, rtp) == LAYOUTS[0] else ["full", "delta"]:
                tag = f"{lr}/{tp}x{pp}/{way}"
                groups = DisaggregatedGroups.create(tp, pp, (lambda t, d, p, tp=tp: t if tp == 2 else p), ENGINES,
                                                    store, rank, everyone, tag=tag)
                opts = (None if way == "full"
                        else DeltaOptions(a.anchor_every, codec="zstd" if "zstd" in way else "none"))
                if rank in TRAINERS:
                    t, p = (rank, 0) if tp == 2 else (0, rank)
                    src = ShardSource(spec, tp, pp, t, p, 0, shards(trainer.hf(), spec, tp, pp, t, p))
                    sides[(tp, pp, rtp), way] = DisaggregatedSender(src, groups, bucket, dtype=BF16, delta=opts)
                else:
                    engine = NativeEngine(read_hf_config(path), comm=TPComm(engine_group if rtp == 2 else None),
                                          dtype="bfloat16")
                    sides[(tp, pp, rtp), way] = DisaggregatedReceiver(engine, spec, groups, BF16, bucket,
                                                                      keep_previous=False, delta=opts)
        log = {key: [] for key in sides}
        identical = True
        tmp = tempfile.TemporaryDirectory()
        disk = DiskWays(trainer.hf(), spec, a, tmp.name, solo) if rank == 0 and a.disk else None
        for step in range(a.steps + 1):               # step 0: the initial weights (the anchors)
            if rank in TRAINERS and step:
                trainer.step()
            full = trainer.hf() if rank in TRAINERS else None
            for key, side in sides.items():
                (tp, pp, rtp), _ = key
                if rank in TRAINERS:
                    t, p = (rank, 0) if tp == 2 else (0, rank)
                    side.src = ShardSource(spec, tp, pp, t, p, 0, shards(full, spec, tp, pp, t, p))
                dist.barrier()
                start = time.perf_counter()
                m = side.sync()
                m["wall"] = time.perf_counter() - start
                log[key].append(m)
            if rank in ENGINES:
                for (lay, way), side in sides.items():
                    if way != "full":
                        identical &= same_bits(side.engine, sides[(lay, "full")].engine)
            if disk is not None:
                disk.step(full)
        if disk is not None:
            disk = disk.result()
        tmp.cleanup()
        copy = {f"{k[0]}|{k[1]}": s.delta_copy_bytes() for k, s in sides.items()
                if rank in TRAINERS and s.delta is not None}
        results.append(dict(lr=lr, log=[[f"{k[0]}|{k[1]}", v] for k, v in log.items()], identical=identical,
                            disk=disk, copy=copy))
        del sides, trainer
    return results


class DiskWays:
    """Trainer rank 0 alone: full HF exports vs delta exports of the same steps, read back."""

    def __init__(self, full, spec, a, tmp, solo):
        from megarl.checkpoint_engine.delta_sync import DeltaOptions
        from megarl.checkpoint_engine.disk import DiskSync
        from megarl.checkpoint_engine.source import ShardSource
        self.spec, self.syncs, self.log, self.identical = spec, {}, {}, True
        for way in ways(a):
            opts = None if way == "full" else DeltaOptions(a.anchor_every, codec="zstd" if "zstd" in way else "none")
            src = ShardSource(spec, 1, 1, 0, 0, 0, shards(full, spec, 1, 1, 0, 0), hf_dtype=BF16)
            self.syncs[way] = DiskSync(src, os.path.join(tmp, way.replace("+", "_")), int(a.bucket_mb * 2**20),
                                       keep=2, group=solo, delta=opts)
            self.log[way] = []

    def step(self, full: dict) -> None:
        from megarl.checkpoint_engine.disk_delta import read_weights
        params = shards(full, self.spec, 1, 1, 0, 0)
        for way, sync in self.syncs.items():
            sync.src.params = params
            start = time.perf_counter()
            m = sync.sync()
            m["wall"] = time.perf_counter() - start
            self.log[way].append(m)
        ref = read_weights(self.syncs["full"].dir)
        for way in list(self.syncs)[1:]:
            got = read_weights(self.syncs[way].dir)
            self.identical &= all(torch.equal(got[n].view(torch.int16), ref[n].view(torch.int16)) for n in ref)

    def result(self) -> dict:
        return dict(log=self.log, identical=self.identical)


# -- report ------------------------------------------------------------------------------------------
def cycle(ms: list[dict], k: int, field: str) -> tuple[float, float, float]:
    """(median of the steady deltas, the anchor's, the mean over one anchor + k - 1 deltas)."""
    anchor = ms[0][field]
    steady = statistics.median(m[field] for m in ms[2:] or ms[1:]) if len(ms) > 1 else anchor
    return steady, anchor, (anchor + (k - 1) * steady) / k


def report(ranks: list, a) -> None:
    for i, r0 in enumerate(ranks[0]):
        lr = r0["lr"]
        logs = {}
        for key, _ in r0["log"]:
            per = [dict(rank[i]["log"])[key] for rank in ranks]
            logs[key] = [{f: max(p[s][f] for p in per) for f in ("wall", "weight_sync/wire_gb")} |
                         {"changed": max(p[s].get("weight_sync/changed_frac", 1.0) for p in per)}
                         for s in range(len(per[0]))]
        first_delta = next(k for k in logs if k.endswith("|delta"))
        fracs = [m["changed"] for m in logs[first_delta][1:]]
        identical = all(rank[i]["identical"] for rank in ranks)
        print(f"\nlr {lr:g} (Adam, bf16 engines): fraction of bf16 elements changed per step: "
              + " ".join(f"{f:.4f}" for f in fracs) + f"; delta engines bit-identical to full after every step: "
              f"{'yes' if identical else 'NO'}")
        head = (f"{'layout -> rollout TP':<22} {'way':<11} {'steady s':>9} {'anchor s':>9} {'avg s':>8} "
                f"{'steady MB':>10} {'avg MB':>9} | {'x fewer bytes':>13} {'x less time':>11}")
        print(head)
        print("-" * len(head))
        for key, ms in logs.items():
            lay, way = key.split("|")
            full = logs[f"{lay}|full"]
            fs = statistics.median(m["wall"] for m in full[1:])
            fb = statistics.median(m["weight_sync/wire_gb"] for m in full[1:])
            k = a.anchor_every if way != "full" else 1
            s, an, avg = cycle(ms, k, "wall") if way != "full" else (fs, fs, fs)
            bs, _, bavg = cycle(ms, k, "weight_sync/wire_gb") if way != "full" else (fb, fb, fb)
            t = eval(lay)
            print(f"({t[0]},{t[1]}) -> {t[2]:<14} {way:<11} {s:>9.3f} {an:>9.3f} {avg:>8.3f} {bs * 1e3:>10.1f} "
                  f"{bavg * 1e3:>9.1f} | {fb / max(bavg, 1e-12):>12.1f}x {fs / avg:>10.1f}x")
        copy = {k: max(rank[i]["copy"].get(k, 0) for rank in ranks) for k in r0["copy"]}
        print("sender's last-sent copy (host memory, per trainer rank): "
              + ", ".join(f"{k.replace('|', ' ')} {v / 2**20:.1f} MiB" for k, v in copy.items()))
        disk = r0["disk"]
        if disk is None:
            continue
        fd = disk["log"]["full"]
        fs = statistics.median(m["wall"] for m in fd[1:])
        fb = statistics.median(m["weight_sync/wire_gb"] for m in fd[1:])
        print(f"disk (trainer TP 1, one writer): full export {fs:.3f} s, {fb * 1e3:.1f} MB; bit-identical read-back: "
              f"{'yes' if disk['identical'] else 'NO'}")
        for way in ways(a)[1:]:
            s, an, avg = cycle(disk["log"][way], a.anchor_every, "wall")
            bs, _, bavg = cycle(disk["log"][way], a.anchor_every, "weight_sync/wire_gb")
            print(f"  {way:<11} steady {s:.3f} s {bs * 1e3:.1f} MB, anchor {an:.3f} s, avg (K={a.anchor_every}) "
                  f"{avg:.3f} s {bavg * 1e3:.1f} MB: {fb / max(bavg, 1e-12):.1f}x fewer bytes, "
                  f"{fs / avg:.1f}x less time")
