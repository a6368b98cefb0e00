"""What TensorRT-LLM is given of the GPU: the KV cache's share of memory, CUDA graphs and the
capacity scheduler (args.py puts them in the LLM's arguments; the engine measures the memory).

    kv_fraction(utilization, free, total, weight_bytes)   verl's fraction of total memory ->
                                                          KvCacheConfig.free_gpu_memory_fraction
"""
from __future__ import annotations

import glob
import os
from typing import Any

import torch

from megarl.config.errors import ConfigError

KEY = "actor_rollout_ref.rollout"


def gpu_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of this rank's GPU now; None off CUDA."""
    return torch.cuda.mem_get_info(device) if device.type == "cuda" else None


def checkpoint_bytes(model_dir: str) -> int:
    """The checkpoint's weights in bytes (its safetensors files): what the engine loads."""
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))


def kv_fraction(utilization: float, free: int, total: int, weight_bytes: int) -> float:
    """KvCacheConfig.free_gpu_memory_fraction for verl's gpu_memory_utilization. verl means a
    fraction of the GPU's total memory for the engine, weights included; TensorRT-LLM sizes its
    KV cache as a fraction of the memory still free once the weights are loaded. Both measured
    here at engine start: what is in use now and this rank's share of the weights come first."""
    after_load = free - weight_bytes
    kv = utilization * total - (total - free) - weight_bytes
    if after_load <= 0 or kv <= 0:
        raise ConfigError(f"gpu_memory_utilization={utilization} of {total / 2**30:.1f} GiB leaves no KV cache: "
                          f"{(total - free) / 2**30:.1f} GiB are in use before the engine starts and its weights take "
                          f"{weight_bytes / 2**30:.1f} GiB; raise gpu_memory_utilization or offload the trainer",
                          f"{KEY}.gpu_memory_utilization")
    return min(kv / after_load, 1.0)


def graph_and_scheduler(max_num_seqs: int, llm_fields: frozenset[str], args_mod: Any) -> dict[str, Any]:
    """CUDA graphs with padding up to max_num_seqs and the MAX_UTILIZATION capacity scheduler,
    as verl's trtllm rollout builds them; each replaceable (or removed with null) through
    engine_kwargs.trtllm. Only where the build has the argument and its class."""
    out: dict[str, Any] = {}
    if "cuda_graph_config" in llm_fields and hasattr(args_mod, "CudaGraphConfig"):
        out["cuda_graph_config"] = args_mod.CudaGraphConfig(enable_padding=True, max_batch_size=max_num_seqs)
    policy = getattr(args_mod, "CapacitySchedulerPolicy", None)
    if "scheduler_config" in llm_fields and hasattr(args_mod, "SchedulerConfig") and policy is not None:
        out["scheduler_config"] = args_mod.SchedulerConfig(capacity_scheduler_policy=policy.MAX_UTILIZATION)
    return out
