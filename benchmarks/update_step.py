"""Time one ActorWorker.update_policy at TP=2 x PP=2 on CPU (4 gloo ranks) for a ~20M-parameter
Qwen2 model, next to the same update done by transformers + torch AdamW in one process.

    python benchmarks/update_step.py [--repeats 5] [--batch 16] [--micro 2] [--prompt 32] [--response 32]
    python benchmarks/update_step.py --smoke        # CI: a tiny model, one repeat (checks it runs, not speed)

Both sides get the same batch, loss (token-mean policy gradient with an entropy bonus), micro-
batching (gradient accumulation) and one optimizer step; the first `--warmup` steps are dropped
and the medians are printed with their ratio. On a 2-core machine the four ranks (one thread each)
share the two cores, so the ratio shows megatron's pipeline/TP overhead on CPU, not a speed-up.
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

from benchmarks.peak_memory import ProcessPeaks  # noqa: E402
from megarl.parallel.local_ranks import run_local  # noqa: E402

SHAPE = dict(vocab_size=16384, hidden_size=256, intermediate_size=768, num_hidden_layers=14,
             num_attention_heads=8, num_key_value_heads=4)
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
SMOKE = dict(repeats=1, warmup=0, batch=4, micro=2, prompt=8, response=8)


def make_batch(vocab: int, B: int, P: int, R: int, seed: int = 0):
    from megarl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    return DataProto.from_dict({"input_ids": ids, "prompt_lens": torch.full((B,), P),
                                "response_lens": torch.full((B,), R),
                                "responses": ids[:, P:].clone(), "response_mask": torch.ones(B, R),
                                "advantages": torch.randn(B, R, generator=g)})


def loss_fn(out, mb):
    m = mb.batch["response_mask"]
    loss = ((-(out["log_probs"] * mb.batch["advantages"]) - 0.01 * out["entropy"]) * m).sum()
    return loss / mb.meta_info["global_tokens"], {}


def megarl_steps(rank, world, path, a):
    import torch.distributed as dist

    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    state.init_distributed()   # the rank set-up: the engine starts no process group
    cfg = ActorConfig(ppo_mini_batch_size=a.batch, ppo_micro_batch_size_per_gpu=a.micro, optim=OptimConfig(lr=1e-5),
                      megatron=MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    actor = ActorWorker(ModelConfig(path=path), cfg)
    data = make_batch(a.shape["vocab_size"], a.batch, a.prompt, a.response)
    times = []
    for _ in range(a.warmup + a.repeats):
        dist.barrier()
        t = time.perf_counter()
        actor.update_policy(data, loss_fn)
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times[a.warmup:], actor.spec.num_parameters()


def transformers_steps(path, a):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    data = make_batch(a.shape["vocab_size"], a.batch, a.prompt, a.response)
    data.meta_info["global_tokens"] = float(data.batch["response_mask"].sum())
    times = []
    for _ in range(a.warmup + a.repeats):
        t = time.perf_counter()
        for mb in data.split(a.micro):
            logits = model(mb.batch["input_ids"]).logits[:, a.prompt - 1:-1].float()
            lsm = logits.log_softmax(-1)
            lp = lsm.gather(-1, mb.batch["responses"].unsqueeze(-1)).squeeze(-1)
            ent = -(lsm.exp() * lsm).sum(-1)
            mb.meta_info.update(data.meta_info)
            loss_fn({"log_probs": lp, "entropy": ent}, mb)[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return times[a.warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the transformers baseline (each megarl rank uses cores/4, at least 1); "
                         "more than 1 suffers badly when other jobs share the cores")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE_SHAPE}, {SMOKE}")
    a = ap.parse_args()
    a.shape = SHAPE
    if a.smoke:
        vars(a).update(SMOKE, shape=SMOKE_SHAPE)
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp, ProcessPeaks() as peaks:
        path = make_tiny_hf(os.path.join(tmp, "model"), "qwen2", tokenizer=False, **a.shape)
        ranks = run_local(4, megarl_steps, (path, a))
        peaks.add(ranks.peak_mb)
        params = ranks[0][1]
        ours = statistics.median(max(r[0][i] for r in ranks) for i in range(a.repeats))
        base = statistics.median(transformers_steps(path, a))
    tokens = a.batch * (a.prompt + a.response)
    print(f"model: Qwen2, {params / 1e6:.1f}M parameters; batch {a.batch} x {a.prompt}+{a.response} tokens "
          f"({tokens} tokens), micro-batch {a.micro}, one optimizer step; {os.cpu_count()} CPU cores")
    print(f"megarl update_policy, TP=2 x PP=2 (4 gloo ranks, 1F1B): {ours:.3f} s (median of {a.repeats})")
    print(f"transformers + torch AdamW, 1 process, {a.threads} thread(s):     {base:.3f} s (median of {a.repeats})")
    print(f"ratio megarl / transformers: {ours / base:.2f} (load average {os.getloadavg()[0]:.1f})")
    print(peaks.line() + " (main: the transformers side; ranks: megarl's)")


if __name__ == "__main__":
    main()
