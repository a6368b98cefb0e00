"""`actor_rollout_ref.rollout.name` -> a rollout engine. Every rank of a rollout TP group calls

    engine = build_rollout(cfg.rollout, model_path, tokenizer, tp_group=group, device="cpu")

Which engines exist and what each can do is declared in megarl/engines/ (one file per engine,
naming its builder); this module looks the name up, refuses the undeclared and the not integrated,
and calls the builder. `engine_kwargs.<name>` reaches the engine verbatim: for native the
NativeEngine options (max_num_seqs, sleep_level, kv_cache_gb, ...), for trtllm the arguments of
tensorrt_llm.LLM. With load_format=dummy (the default, as in verl) the built-in engines start
without weights and refuse to generate until the trainer's first weight sync; any other value
loads `model_path`.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megarl.config.errors import ConfigError
from megarl.engines import EngineInfo, resolve
from megarl.models.hf_config import hf_overrides
from megarl.rollout.base import RolloutEngine
from megarl.rollout.build_args import BuildRequest
from megarl.rollout.config import RolloutConfig
from megarl.rollout.cost_model import pace
from megarl.rollout.custom import load_user_class


def abilities(cfg: RolloutConfig) -> EngineInfo:
    """What the configured engine can do; for a user's class, what the class declares."""
    info = resolve(cfg.name)
    if info.user_class:
        info = info.declared_by(load_user_class(cfg.custom_cls_path, cfg.custom_cls_name))
    return info


def _builder(info: EngineInfo) -> Callable[[BuildRequest], RolloutEngine]:
    module, _, function = info.build.partition(":")
    return getattr(importlib.import_module(module), function)


def build_rollout(cfg: RolloutConfig, model_path: str, tokenizer=None, tp_group=None,
                  device: str | torch.device = "cpu", role: str = "rollout",
                  override_config: Mapping[str, Any] | None = None) -> RolloutEngine:
    """`override_config`: the actor's model.override_config, applied to the engine's model as the
    trainer applies it to its own (refused for an engine that does not declare takes_hf_overrides)."""
    info = resolve(cfg.name)     # a user's class is loaded once, by its builder
    overrides = hf_overrides(override_config or {})
    refusal = info.overrides_refusal(sorted(overrides))
    if refusal and not info.user_class:      # a user's class: refused by build_custom, from what it declares
        raise ConfigError(refusal, "actor_rollout_ref.model.override_config")
    request = BuildRequest(cfg, model_path, tokenizer, tp_group, torch.device(device), role, info, overrides)
    return pace(_builder(info)(request), cfg.cost_model)
