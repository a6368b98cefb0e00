"""One device's update step: update_policy and compute_log_prob MFU, peak memory per phase, what
offload frees, and the weight sync into the built-in engine, on one rank.

    python benchmarks/gpu_update_step.py --device cuda --shape 0.86b            # the GPU issue's benchmark
    python benchmarks/gpu_update_step.py --device cpu --shape tiny --peak-tflops 0.1   # plumbing, seconds
    python benchmarks/gpu_update_step.py --smoke        # CI: the tiny shape on CPU, one repeat

The 0.86b shape is a random Qwen2 model: hidden 2048, 16 layers, 16 heads / 4 KV heads, FFN 5632,
vocab 32768; each update is 32 sequences of 256 prompt + 768 response tokens, bf16, one
optimizer step, distributed optimizer on (megatron's; CPU has no distributed optimizer: off there).
MFU is model FLOPs (megarl/models/flops.py, real tokens, causal attention) over the median
seconds after warm-up and the device's peak (megarl/trainer/metrics/mfu.py, or --peak-tflops).
Offload: device bytes the actor holds in weights, grad buffers and optimizer state before and
after `offload` of all three, and torch.cuda.memory_allocated around it (the issue-13 target:
<= 10% held during rollout). Weight sync: megarl's colocated sync into a native engine on the same
device, seconds and model GB/s (median of --repeats after one warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SHAPES = {
    "0.86b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}
SMOKE = dict(device="cpu", shape="tiny", log_prob_micro=4, repeats=1, warmup=0, peak_tflops=0.1)
# (sequences, prompt, response) per update
BATCH = {"0.86b": (32, 256, 768), "tiny": (4, 8, 8)}


def make_batch(vocab: int, B: int, P: int, R: int, seed: int = 0):
    from megarl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    return DataProto.from_dict({"input_ids": ids, "prompt_lens": torch.full((B,), P),
                                "response_lens": torch.full((B,), R), "responses": ids[:, P:].clone(),
                                "response_mask": torch.ones(B, R), "advantages": torch.randn(B, R, generator=g)})


def loss_fn(out, mb):
    m = mb.batch["response_mask"]
    loss = ((-(out["log_probs"] * mb.batch["advantages"])) * m).sum()
    return loss / mb.meta_info["global_tokens"], {}


def _timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(rank: int, world: int, path: str, a) -> dict:
    """Runs on one spawned rank (megarl.parallel.local_ranks.run_local)."""
    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.experiment import load_config
    from megarl.models.flops import forward_flops, training_flops
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.native import NativeEngine, TPComm
    from megarl.trainer.metrics.memory import PhaseMemory
    from megarl.trainer.metrics.mfu import resolve_peak_flops
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig

    B, P, R = BATCH[a.shape]
    cuda = a.device == "cuda"
    cfg = ActorConfig(ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=a.micro,
                      log_prob_micro_batch_size_per_gpu=a.log_prob_micro, optim=OptimConfig(lr=1e-6),
                      megatron=MegatronConfig(use_distributed_optimizer=cuda and not a.no_dist_opt),
                      dtype="bfloat16" if cuda else "float32")
    state.init_distributed()   # the rank set-up: the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path, enable_gradient_checkpointing=a.recompute), cfg)
    dev = actor.engine.device
    data = make_batch(actor.spec.vocab_size, B, P, R)
    mem = PhaseMemory(dev)
    upd, lp = [], []
    for i in range(a.warmup + a.repeats):
        with mem.phase("update_actor"):
            t_upd = _timed(dev, lambda: actor.update_policy(data, loss_fn, with_entropy=False))
        with mem.phase("old_log_prob"):
            t_lp = _timed(dev, lambda: actor.compute_log_prob(data, with_entropy=False))
        if i >= a.warmup:
            upd.append(t_upd)
            lp.append(t_lp)
    memory = mem.metrics()
    lens = [P + R] * B
    peak, why = resolve_peak_flops(a.peak_tflops, dev)
    f_upd = training_flops(actor.spec, lens, recompute=a.recompute)
    f_lp = forward_flops(actor.spec, lens)
    out = {"shape": a.shape, "params": actor.spec.num_parameters(), "device": str(dev),
           "dtype": str(actor.engine.dtype).replace("torch.", ""), "batch": [B, P, R], "micro": a.micro,
           "distributed_optimizer": cfg.megatron.use_distributed_optimizer, "recompute": a.recompute,
           "update_policy_s": statistics.median(upd), "compute_log_prob_s": statistics.median(lp),
           "update_policy_tflops": f_upd / statistics.median(upd) / 1e12,
           "compute_log_prob_tflops": f_lp / statistics.median(lp) / 1e12,
           "peak_tflops": peak / 1e12 if peak else None, "peak_source": why, "memory": memory}
    if peak:
        out["update_policy_mfu"] = f_upd / statistics.median(upd) / peak
        out["compute_log_prob_mfu"] = f_lp / statistics.median(lp) / peak

    # offload: what the trainer would still hold while the engine generates
    eng = actor.engine
    alloc = torch.cuda.memory_allocated(dev) if cuda else None
    before = eng.resident_bytes()
    moved = eng.offload(params=True, grads=True, optimizer=True)
    after = eng.resident_bytes()
    out["offload"] = {"resident_gb_before": before / 2**30, "resident_gb_after": after / 2**30,
                      "moved_gb": moved / 2**30,
                      "allocated_gb_before": alloc / 2**30 if cuda else None,
                      "allocated_gb_after": torch.cuda.memory_allocated(dev) / 2**30 if cuda else None}
    t_on = _timed(dev, eng.onload)
    out["offload"]["onload_s"] = t_on

    # weight sync into the built-in engine on the same device
    engine = NativeEngine(read_hf_config(path), comm=TPComm(None), device=dev, dtype="auto", kv_cache_gb=1.0)
    ecfg = load_config(None, [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=1",
                              f"trainer.device={a.device}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=4"])
    sync = build_checkpoint_engine(ecfg, actor, engine, None)
    runs = [sync.sync() for _ in range(1 + a.repeats)][1:]
    secs = statistics.median(r["weight_sync/seconds"] for r in runs)
    gb = runs[0]["weight_sync/gb"]
    out["weight_sync"] = {"seconds": secs, "gb": gb, "gb_per_s": gb / secs}
    return out


def run(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.86b")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--log-prob-micro", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--recompute", action="store_true", help="full activation recompute (FLOPs x4/3)")
    ap.add_argument("--no-dist-opt", action="store_true",
                    help="megatron's plain optimizer instead of the distributed one")
    ap.add_argument("--peak-tflops", type=float, default=None, help="one device's peak (default: by GPU name)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape on CPU: {SMOKE}")
    a = ap.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_update_step: no CUDA device visible; use --device cpu --shape tiny for a dry run")
    from megarl.models.tiny import make_tiny_hf
    from megarl.parallel.local_ranks import run_local
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_dir or os.path.join(tmp, "model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            make_tiny_hf(path, "qwen2", tokenizer=False, **SHAPES[a.shape])
        ranks = run_local(1, measure, (path, a))
        result = {**ranks[0], "peak_resident_mb": ranks.peak_mb}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def table(r: dict) -> str:
    B, P, R = r["batch"]
    lines = [f"model: Qwen2 {r['shape']} ({r['params'] / 1e9:.2f}B parameters), {r['device']} {r['dtype']}; "
          f"{B} sequences x {P}+{R} tokens, micro-batch {r['micro']}, distributed optimizer "
          f"{'on' if r['distributed_optimizer'] else 'off'}; medians after warm-up; load average "
          f"{os.getloadavg()[0]:.1f}"]
    for k in ("update_policy", "compute_log_prob"):
        mfu = r.get(f"{k}_mfu")
        lines.append(f"  {k:17s} {r[k + '_s']:.3f} s  {r[k + '_tflops']:.1f} TFLOP/s  MFU "
              + (f"{mfu:.3f} (peak {r['peak_tflops']:g} TFLOP/s)" if mfu is not None else f"n/a ({r['peak_source']})"))
    o = r["offload"]
    lines.append(f"  offload: trainer state on the device {o['resident_gb_before']:.2f} GB -> "
          f"{o['resident_gb_after']:.2f} GB; "
          f"onload {o['onload_s']:.3f} s")
    w = r["weight_sync"]
    lines.append(f"  weight sync -> native engine: {w['seconds']:.3f} s, {w['gb_per_s']:.2f} GB/s ({w['gb']:.2f} GB)")
    lines.append(f"  peak memory per phase: {json.dumps({k: round(v, 3) for k, v in r['memory'].items()})}")
    peaks = ", ".join(f"rank {i} {mb:.0f}" for i, mb in enumerate(r["peak_resident_mb"]))
    lines.append(f"  peak resident MiB: {peaks}")
    return "\n".join(lines)


def main() -> None:
    print(table(run()))


if __name__ == "__main__":
    main()
