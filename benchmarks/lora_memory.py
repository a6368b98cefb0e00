"""LoRA against full fine-tuning on the same model and batch: trainable parameters, optimizer
state bytes, gradient-buffer bytes, the update's peak memory and its time (docs/lora.md).

    python benchmarks/lora_memory.py                      # CPU, a 4-layer 512-wide Qwen2 (~2 min idle)
    python benchmarks/lora_memory.py --rank 16 --device cuda
    python benchmarks/lora_memory.py --smoke              # CI: a tiny shape, one repeat

One process (TP = PP = DP = 1). Peak memory: the update's forward + backward over the whole
mini-batch (benchmarks/update_memory.py's measure: torch.cuda.max_memory_allocated above what
was held before, or on CPU the peak of live tensor bytes from torch's profiler). Time: the median
of `--repeats` update_policy calls (forward, backward and optimizer step) after one warm-up.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

SMOKE = dict(hidden=64, layers=2, vocab=512, batch=4, micro=2, prompt=8, response=16, repeats=1)


def run(path: str, a, rank: int, data) -> dict:
    import torch

    from benchmarks.update_memory import loss_fn, peak_bytes
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, ModelConfig, OptimConfig
    cfg = ActorConfig(ppo_mini_batch_size=a.batch, ppo_micro_batch_size_per_gpu=a.micro, optim=OptimConfig(lr=1e-6))
    state.init_distributed()   # the rank set-up: the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path, lora_rank=rank, lora_alpha=2 * max(rank, 1)), cfg)
    eng = actor.engine
    up = lambda: actor.update_policy(data, loss_fn)  # noqa: E731
    up()                                            # warm-up; Adam's state exists from here
    times = []
    for _ in range(a.repeats):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        up()
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    fwd_bwd = lambda: eng.accumulate(data, a.micro, actor._process(1.0, True), loss_fn)  # noqa: E731
    peak = peak_bytes(fwd_bwd, a.device)
    mem = eng.memory
    # Adam's moments and (below fp32) master weights; fp32 weights are their own masters, not counted
    weights = {id(p) for p in eng.parameters()}
    optim_bytes = sum(t.numel() * t.element_size() for t in mem.optimizer_tensors() if id(t) not in weights)
    grad_bytes = sum(t.numel() * t.element_size() for t in mem.grad_tensors())
    out = {"name": f"LoRA r={rank}" if rank else "full", "total": sum(p.numel() for p in eng.parameters()),
           "trainable": sum(p.numel() for p in eng.parameters() if p.requires_grad),
           "optim_mib": optim_bytes / 2**20, "grad_mib": grad_bytes / 2**20, "peak_mib": peak / 2**20,
           "step_s": statistics.median(times)}
    actor = eng = mem = None
    gc.collect()
    state.destroy_model_parallel()
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megarl.parallel.local_ranks import free_port  # after sys.path names this checkout
    os.environ.setdefault("MASTER_PORT", str(free_port()))    # not a fixed one another run may hold
    from benchmarks.update_memory import make_batch
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp:
        heads = max(2, a.hidden // 64)
        path = make_tiny_hf(os.path.join(tmp, "model"), "qwen2", vocab_size=a.vocab, hidden_size=a.hidden,
                            intermediate_size=3 * a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 2), tokenizer=False)
        data = make_batch(a.vocab, a.batch, a.prompt, a.response, a.response / 2)
        results = [run(path, a, r, data) for r in (0, a.rank)]
    print(f"hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; batch {a.batch} rows of <= {a.prompt}+{a.response} "
          f"tokens, micro {a.micro}; device {a.device}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<12}{'params':>12}{'trainable':>12}{'optim MiB':>11}{'grads MiB':>11}{'fwd+bwd MiB':>13}"
          f"{'update s':>10}")
    for r in results:
        print(f"{r['name']:<12}{r['total']:>12,}{r['trainable']:>12,}{r['optim_mib']:>11.2f}{r['grad_mib']:>11.2f}"
              f"{r['peak_mib']:>13.1f}{r['step_s']:>10.3f}")
    return results


if __name__ == "__main__":
    main()
