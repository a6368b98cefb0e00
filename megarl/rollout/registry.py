"""`actor_rollout_ref.rollout.name` -> a rollout engine. Every rank of a rollout TP group calls

    engine = build_rollout(cfg.rollout, model_path, tokenizer, tp_group=group, device="cpu")

native   built in (megarl/rollout/native), TP over `tp_group`, the default
trtllm   TensorRT-LLM's LLM API, PyTorch backend (megarl/rollout/trtllm.py)
hf       transformers' generate, one whole model per rank (megarl/rollout/hf.py)
custom   a user's BaseRollout subclass from custom_cls_path / custom_cls_name (megarl/rollout/custom.py)

`engine_kwargs.<name>` reaches the engine verbatim: for native the NativeEngine options
(max_num_seqs, sleep_level, kv_cache_gb, ...), for trtllm the arguments of tensorrt_llm.LLM.
With load_format=dummy (the default, as in verl) native/hf/trtllm start without weights and
refuse to generate until the trainer's first weight sync; any other value loads `model_path`.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from megarl.config.errors import ConfigError
from megarl.config.typed import closest
from megarl.rollout.base import RolloutEngine
from megarl.rollout.config import RolloutConfig
from megarl.rollout.custom import CustomRollout, load_user_class
from megarl.rollout.hf import HFEngine
from megarl.models.hf_config import hf_vocab_size, read_hf_config
from megarl.rollout.native import NativeEngine, TPComm, host_budget
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.trtllm import TRTLLMEngine

ENGINES = ("native", "trtllm", "hf", "custom")
NOT_INTEGRATED = ("vllm", "sglang")
_KEY = "actor_rollout_ref.rollout"


def _pad_id(tokenizer) -> int:
    """Padding for packed batches: the tokenizer's pad, else its EOS, else 0 (masked out anyway)."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return value
    return 0


def _vocab_size(model_path: str | None, tokenizer) -> int | None:
    """The model's vocabulary (config.json), else the tokenizer's, else unknown (no id check)."""
    V = hf_vocab_size(model_path)
    if V is not None:
        return V
    return len(tokenizer) if tokenizer is not None else None


def _options(engine_cls, defaults: dict[str, Any], user: dict[str, Any], name: str) -> dict[str, Any]:
    # record_routes follows rollout.enable_rollout_routing_replay (verl's key), never engine_kwargs.
    allowed = set(inspect.signature(engine_cls.__init__).parameters) - {"self", "hf_config", "model_dir", "comm",
                                                                         "device", "config", "record_routes"}
    for key in user:
        if key not in allowed:
            hint = closest(key, sorted(allowed))
            raise ConfigError(f"unknown option {key!r} for the {name} engine"
                              + (f"; did you mean {hint!r}?" if hint else f" (options: {', '.join(sorted(allowed))})"),
                              f"{_KEY}.engine_kwargs.{name}.{key}")
    return {**defaults, **user}


def build_rollout(cfg: RolloutConfig, model_path: str, tokenizer=None, tp_group=None,
                  device: str | torch.device = "cpu", role: str = "rollout") -> RolloutEngine:
    name = cfg.name
    if name in NOT_INTEGRATED:
        raise ConfigError(f"{name} is not integrated in megarl; use rollout.name=native (built in, any "
                          "device) or rollout.name=trtllm (TensorRT-LLM on NVIDIA GPUs)", f"{_KEY}.name")
    if name not in ENGINES:
        hint = closest(name, list(ENGINES))
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}"
                          + (f" (did you mean {hint!r}?)" if hint else ""), f"{_KEY}.name")
    pad = _pad_id(tokenizer)
    user = dict(cfg.engine_kwargs.get(name) or {})
    device = torch.device(device)

    if name == "native":
        comm = TPComm(tp_group)
        if tp_group is not None and comm.size != cfg.tensor_model_parallel_size:
            raise ConfigError(f"the rollout TP group has {comm.size} ranks but tensor_model_parallel_size="
                              f"{cfg.tensor_model_parallel_size}", f"{_KEY}.tensor_model_parallel_size")
        # Weights that come from the trainer every step need not survive sleep (level 2).
        defaults = dict(dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs, prompt_length=cfg.prompt_length,
                        prompt_truncation=cfg.prompt_truncation, sleep_level=2 if cfg.load_format == "dummy" else 1,
                        gpu_memory_utilization=cfg.gpu_memory_utilization,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, enforce_eager=bool(cfg.enforce_eager))
        held = host_budget.resident_bytes()     # before the engine's weights
        engine = NativeEngine(read_hf_config(model_path), comm=comm, device=device, config=cfg,
                              record_routes=cfg.enable_rollout_routing_replay,
                              **_options(NativeEngine, defaults, user, name))
        if device.type != "cuda":               # several ranks share the host: stop now if a step cannot fit
            host_budget.check_fits(engine, cfg.prompt_length or 1, cfg.response_length or 1, cfg.n,
                                   int(cfg.checkpoint_engine.bucket_size_mb * 2**20), held_before=held)
        if cfg.load_format != "dummy":
            engine.load_hf_dir(model_path)
        return engine

    if name == "hf":
        if cfg.tensor_model_parallel_size != 1:
            raise ConfigError("the hf engine holds one whole model per rank; set tensor_model_parallel_size=1 "
                              "or use rollout.name=native for TP", f"{_KEY}.tensor_model_parallel_size")
        defaults = dict(dtype=cfg.dtype, prompt_length=cfg.prompt_length, prompt_truncation=cfg.prompt_truncation,
                        pad_token_id=pad, load_format=cfg.load_format)
        return HFEngine(model_path, device=device, config=cfg, **_options(HFEngine, defaults, user, name))

    if name == "trtllm":
        return TRTLLMEngine(model_path, cfg, tp_group=tp_group, pad_token_id=pad,
                            device=device if device.type == "cuda" else None)

    cls = load_user_class(cfg.custom_cls_path, cfg.custom_cls_name)
    try:
        user_engine = cls(cfg, role, **user)
    except TypeError as err:
        raise ConfigError(f"{cls.__name__}(config, role, **engine_kwargs.custom) failed: {err}",
                          f"{_KEY}.custom_cls_name") from err
    guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation, vocab_size=_vocab_size(model_path, tokenizer))
    return CustomRollout(user_engine, tokenizer=tokenizer, guard=guard, pad_token_id=pad)
