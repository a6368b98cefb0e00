"""RewardModelWorker: a frozen critic-style backbone whose score head rates whole responses.

    rm = RewardModelWorker.from_config(cfg)          # reward_model.enable=true, reward_model.model.path=DIR
    scores = rm.compute_scores(batch)                # [B]: the head's output at each sequence's last token

DIR is an HF `*ForSequenceClassification` checkpoint with one label (`score.weight`), as
transformers and TRL save reward models; the head is read at the last token of prompt +
response, which is where transformers' own model reads it for unpadded rows. The reward manager
then uses these as `rm_scores` (megarl/reward/manager.py). It shares the actor's token ids, so
its vocabulary must match the actor's.
"""
from __future__ import annotations

import torch

from megarl.config import ConfigError
from megarl.models.hf_config import find_hf_config as read_hf_config
from megarl.protocol import DataProto
from megarl.reward.config_checks import RM_MODEL_KEYS
from megarl.workers.actor import engine_spec
from megarl.workers.config import ModelConfig
from megarl.workers.engine import MegatronEngine

_KEY = "reward_model.model.path"


def _last_token_scores(values: torch.Tensor, mb: DataProto) -> dict[str, torch.Tensor]:
    """values [b, s, 1] (or packed [1, T, 1]) -> scores [b] at each row's last token."""
    if "last_index" in mb.batch:  # set by the engine, padded or packed layout alike
        return {"scores": values.flatten(0, 1)[mb.batch["last_index"].to(values.device), 0].float()}
    last = (mb.batch["prompt_lens"] + mb.batch["response_lens"] - 1).clamp(min=0).to(values.device)
    return {"scores": values.squeeze(-1).gather(1, last[:, None]).squeeze(1).float()}


class RewardModelWorker:
    def __init__(self, model: ModelConfig, role_cfg, actor_vocab: int | None, micro_batch_size: int = 4,
                 dtype: str = "auto"):
        hf = read_hf_config(model.path) if model.path else None
        if hf is None:
            raise ConfigError("reward_model.enable needs an HF reward-model directory (a *ForSequenceClassification "
                              "checkpoint with config.json)", _KEY)
        if actor_vocab is not None and hf.get("vocab_size") != actor_vocab:
            raise ConfigError(f"the reward model's vocabulary ({hf.get('vocab_size')}) differs from the actor's "
                              f"({actor_vocab}); it must share the actor's tokenizer", _KEY)
        self.micro = micro_batch_size
        self.engine = MegatronEngine(engine_spec(model, role_cfg, head="value", trainable=False, dtype=dtype,
                                                 head_from_checkpoint=True,
                                                 role="reward_model"))

    @classmethod
    def from_config(cls, cfg) -> "RewardModelWorker":
        rm = cfg.reward_model
        # verl's reward_model.model keys that build a model (megarl/reward/config_checks.py has the others)
        model = ModelConfig(**{k: v for k, v in rm.model.items() if k in RM_MODEL_KEYS and v is not None})
        actor_hf = read_hf_config(cfg.model.path) or {}
        return cls(model, cfg.actor, actor_hf.get("vocab_size"), rm.micro_batch_size_per_gpu, cfg.actor.dtype)

    def compute_scores(self, data: DataProto) -> torch.Tensor:
        return self.engine.forward_rows(data, self.micro, _last_token_scores, ("scores",), {"scores": ()})["scores"]
