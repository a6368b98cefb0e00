"""Per-step data, timing and throughput metrics, with verl's names.

    metrics.update(compute_data_metrics(batch, max_response_length=cfg.data.max_response_length))
    metrics.update(compute_timing_metrics(batch, timings))           # timings: {"gen": 1.2, "step": 3.4, ...}
    metrics.update(compute_throughput_metrics(batch, timings["step"], n_devices=world_size))
"""
from __future__ import annotations

import torch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    if x.numel() == 0:
        return {}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def response_lengths(batch) -> torch.Tensor:
    b = batch.batch
    return (b["response_lens"] if "response_lens" in b else b["response_mask"].sum(-1)).float()


def prompt_lengths(batch) -> torch.Tensor | None:
    b, nt = batch.batch, batch.non_tensor_batch
    if "prompt_lens" in b:
        return b["prompt_lens"].float()
    if "prompt_token_ids" in nt:
        return torch.tensor([len(p) for p in nt["prompt_token_ids"]], dtype=torch.float32)
    return None


@torch.no_grad()
def compute_data_metrics(batch, max_response_length: int | None = None, max_prompt_length: int | None = None) -> dict:
    """Scores, rewards, advantages, returns, values and lengths of one step's batch."""
    b = batch.batch
    mask = b["response_mask"].float()
    valid = mask > 0
    out: dict[str, float] = {}
    if "token_level_scores" in b:
        out.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    if "token_level_rewards" in b:
        out.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in b:
            out.update(_stats(name, b[key][valid]))
    if "values" in b and "returns" in b:
        ret, val = b["returns"][valid].float(), b["values"][valid].float()
        var_ret = ret.var(unbiased=False)
        out["critic/vf_explained_var"] = (1 - (ret - val).var(unbiased=False) / (var_ret + 1e-5)).item()
    lens = response_lengths(batch)
    out.update(_stats("response_length", lens))
    if max_response_length:
        out["response_length/clip_ratio"] = (lens >= max_response_length).float().mean().item()
    elif "finish_reasons" in batch.non_tensor_batch:
        reasons = batch.non_tensor_batch["finish_reasons"]
        out["response_length/clip_ratio"] = sum(r == "length" for r in reasons) / max(len(reasons), 1)
    plens = prompt_lengths(batch)
    if plens is not None:
        out.update(_stats("prompt_length", plens))
        if max_prompt_length:
            out["prompt_length/clip_ratio"] = (plens >= max_prompt_length).float().mean().item()
    return out


def total_tokens(batch) -> tuple[int, int]:
    """(prompt tokens, response tokens) in the batch."""
    plens = prompt_lengths(batch)
    return int(plens.sum().item()) if plens is not None else 0, int(response_lengths(batch).sum().item())


def compute_timing_metrics(batch, timings: dict[str, float]) -> dict[str, float]:
    """timing_s/<phase> and timing_per_token_ms/<phase> (generation per response token, the
    other phases per prompt + response token)."""
    prompt_tok, resp_tok = total_tokens(batch)
    out = {f"timing_s/{k}": float(v) for k, v in timings.items()}
    for name, seconds in timings.items():
        tokens = resp_tok if name == "gen" else prompt_tok + resp_tok
        if tokens and name != "step":
            out[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens
    return out


def compute_throughput_metrics(batch, step_seconds: float, n_devices: int) -> dict[str, float]:
    """perf/throughput: prompt + response tokens per second per device, over the whole step."""
    prompt_tok, resp_tok = total_tokens(batch)
    total = prompt_tok + resp_tok
    return {"perf/total_num_tokens": total, "perf/time_per_step": step_seconds,
            "perf/throughput": total / max(step_seconds, 1e-9) / max(n_devices, 1)}
