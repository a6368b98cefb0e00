"""Step metrics under verl 0.9.1's names where megarl's own differ (RayPPOTrainer.fit, metric_utils,
engine_workers, seqlen_balancing), so a verl user's dashboards read a megarl run:

    training/global_step, training/epoch     the step (1-based) and the epoch its prompts came from (0-based)
    response/aborted_ratio                   share of responses with no token
    global_seqlen/{min,max,minmax_diff,balanced_min,balanced_max,mean}
                                             prompt + response tokens per data-parallel rank; megarl does
                                             not reorder rows (verl's trainer.balance_batch), so balanced_*
                                             are the split it trains on, as are min/max
    perf/max_memory_allocated_gb, perf/max_memory_reserved_gb (CUDA), perf/cpu_memory_used_gb
"""
from __future__ import annotations

import psutil
import torch

from megarl.algos.metrics import prompt_lengths, response_lengths


def seqlen_balance(seqlens: list[int], dp: int, prefix: str = "global_seqlen") -> dict[str, int]:
    """verl's log_seqlen_unbalance for contiguous data-parallel shards: the split megarl trains on."""
    size = max(len(seqlens) // max(dp, 1), 1)
    sums = [sum(seqlens[i:i + size]) for i in range(0, len(seqlens), size)]
    return {f"{prefix}/min": min(sums), f"{prefix}/max": max(sums), f"{prefix}/minmax_diff": max(sums) - min(sums),
            f"{prefix}/balanced_min": min(sums), f"{prefix}/balanced_max": max(sums),
            f"{prefix}/mean": sum(seqlens) / len(sums)}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's worker memory readings: the device's peaks since its last reset (megarl resets them at
    each phase, so after the actor update they are that phase's), and the host's used memory."""
    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def verl_step_metrics(step: int, batch, dp: int) -> dict[str, float]:
    lens = response_lengths(batch)
    plens = prompt_lengths(batch)
    out = {"training/global_step": step, "training/epoch": int(batch.meta_info.get("epoch", 0)),
           "response/aborted_ratio": (lens == 0).float().mean().item()}
    if plens is not None:
        out.update(seqlen_balance((plens + lens).long().tolist(), dp))
    return out
