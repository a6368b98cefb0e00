"""What every engine's builder receives (megarl/engines/<name>.py names the builder), and the
pieces several builders share."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.config.errors import ConfigError
from megarl.config.typed import closest
from megarl.engines import EngineInfo
from megarl.models.hf_config import hf_vocab_size, with_overrides
from megarl.rollout.config import RolloutConfig

KEY = "actor_rollout_ref.rollout"


@dataclass
class BuildRequest:
    cfg: RolloutConfig
    model_path: str
    tokenizer: Any
    tp_group: Any                     # the rollout TP group, or None for one rank
    device: torch.device
    role: str
    info: EngineInfo                  # the engine's declaration (a user class's: what it declares)
    # The actor's model.override_config as HF config keys (hf_config.hf_overrides): the trainer's
    # model is built from config.json with these applied, so the engine's must be too.
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def user_kwargs(self) -> dict[str, Any]:
        """engine_kwargs.<name>, verbatim."""
        return dict(self.cfg.engine_kwargs.get(self.cfg.name) or {})


def pad_id(tokenizer) -> int:
    """Padding for packed batches: the tokenizer's pad, else its EOS, else 0 (masked out anyway).
    The one place the pad id is chosen: the engines' builders and the trainer's batches read it here."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return value
    return 0


def vocab_size(model_path: str | None, tokenizer) -> int | None:
    """The model's vocabulary (config.json), else the tokenizer's, else unknown (no id check)."""
    V = hf_vocab_size(model_path)
    if V is not None:
        return V
    return len(tokenizer) if tokenizer is not None else None


def override_values(hf_config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Each overridden key with its value after megarl's merge (a mapping such as rope_scaling merges
    into config.json's): an engine that sets whole attributes then sets the trainer's values."""
    merged = with_overrides(hf_config, overrides)
    return {key: merged[key] for key in overrides}


def engine_options(engine_cls, defaults: dict[str, Any], user: dict[str, Any], name: str) -> dict[str, Any]:
    """`defaults` overridden by engine_kwargs.<name>, each key checked against the constructor."""
    # record_routes follows rollout.enable_rollout_routing_replay (verl's key), hf_overrides the actor's
    # model.override_config: never engine_kwargs.
    allowed = set(inspect.signature(engine_cls.__init__).parameters) - {"self", "hf_config", "model_dir", "comm",
                                                                         "device", "config", "record_routes",
                                                                         "hf_overrides"}
    for key in user:
        if key not in allowed:
            hint = closest(key, sorted(allowed))
            raise ConfigError(f"unknown option {key!r} for the {name} engine"
                              + (f"; did you mean {hint!r}?" if hint else f" (options: {', '.join(sorted(allowed))})"),
                              f"{KEY}.engine_kwargs.{name}.{key}")
    return {**defaults, **user}
