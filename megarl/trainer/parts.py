"""Build every part of a run from the config, on every rank.

    parts = build_parts(cfg, ranks, log)

Order matters for memory and for errors: the model checkpoint is created if asked (rank 0, the
others wait), its config is checked against the layout before any weights load, then the
megatron roles, the rollout engine and the weight sync are built.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megarl.config import ConfigError
from megarl.config.experiment import read_hf_config
from megarl.config.model_path import model_path_state


@dataclass
class Parts:
    tokenizer: Any
    pad_token_id: int
    train_loader: Any
    val_loader: Any
    actor: Any
    ref: Any                      # None unless a KL term needs it
    critic: Any                   # None unless the critic is on
    rollout: Any
    weight_sync: Any
    reward: Any                   # rank 0 only; None elsewhere
    reward_model: Any             # None unless reward_model.enable
    kl_ctrl: Any
    total_steps: int

    def padding_metrics(self) -> dict:
        """perf/padding_ratio: tokens the megatron roles computed / real tokens, over every pass
        since the last call (log-probs, values, updates); 1.0 means no compute went to padding."""
        computed = real = 0
        for role in (self.actor, self.ref, self.critic, self.reward_model):
            if role is not None and hasattr(role, "engine"):
                c, r = role.engine.take_padding()
                computed, real = computed + c, real + r
        return {"perf/padding_ratio": computed / real} if real else {}

    def trainable_roles(self) -> dict:
        roles = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles


def import_path(spec: str, key: str):
    """`pkg.module:attr` -> the object, with a one-line error naming the key."""
    import importlib
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        return getattr(obj, attr) if attr else obj
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import {spec!r} ({err}); give it as package.module:function", key) from None


def ensure_model(cfg, ranks) -> None:
    """Create the HF checkpoint with `model.bootstrap` when it is missing (rank 0; others wait)."""
    m = cfg.model
    if not m.path:
        raise ConfigError("no model: set actor_rollout_ref.model.path to an HF checkpoint directory",
                          "actor_rollout_ref.model.path")
    if ranks.is_main and model_path_state(m.path, m.bootstrap) == "bootstrap":   # config/model_path.py's rules
        import_path(m.bootstrap, "actor_rollout_ref.model.bootstrap")(m.path, cfg, **m.bootstrap_kwargs)
    dist.barrier()
    hf = read_hf_config(m.path)
    if hf is None:
        raise ConfigError(f"{m.path} still holds no config.json after bootstrap", "actor_rollout_ref.model.bootstrap")
    cfg.check_model(hf)


def total_steps(cfg, loader) -> int:
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * loader.batches_per_epoch


def build_parts(cfg, ranks, log) -> Parts:
    from transformers import AutoTokenizer

    from megarl.algos.kl import make_kl_controller
    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.data.build import build_loaders
    from megarl.reward.manager import build_reward_manager
    from megarl.rollout.registry import build_rollout
    from megarl.workers.actor import ActorWorker
    from megarl.workers.critic import CriticWorker
    from megarl.workers.reference import ReferenceWorker

    ensure_model(cfg, ranks)
    m = cfg.model
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_loader, val_loader = build_loaders(cfg.data, tokenizer)
    for loader in (train_loader, val_loader):
        summary = getattr(getattr(loader, "dataset", None), "summary", None)
        if summary is not None:
            log.info(f"megarl: {summary()}")
    steps = total_steps(cfg, train_loader)
    for optim in (cfg.actor.optim, cfg.critic.optim):
        if optim.total_training_steps < 0:
            optim.total_training_steps = steps

    actor = ActorWorker.from_config(cfg)
    needs_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = ReferenceWorker.from_config(cfg) if needs_ref else None
    critic = CriticWorker.from_config(cfg) if cfg.critic.enable else None
    reward_model = None
    if cfg.reward_model.enable:
        from megarl.workers.reward_model import RewardModelWorker
        reward_model = RewardModelWorker.from_config(cfg)
    rollout = build_rollout(cfg.rollout, m.path, tokenizer, tp_group=ranks.rollout_group, device=ranks.device)
    if cfg.rollout.multi_turn.enable:
        from megarl.rollout.multiturn import build_agent_loop
        rollout = build_agent_loop(cfg, rollout, tokenizer)
    weight_sync = build_checkpoint_engine(cfg, actor, rollout, ranks.rollout_group)
    reward = build_reward_manager(cfg, tokenizer) if ranks.is_main else None
    return Parts(tokenizer=tokenizer, pad_token_id=pad, train_loader=train_loader, val_loader=val_loader,
                 actor=actor, ref=ref, critic=critic, rollout=rollout, weight_sync=weight_sync, reward=reward,
                 reward_model=reward_model, kl_ctrl=make_kl_controller(cfg.algorithm.kl_ctrl), total_steps=steps)


def write_run_dir(cfg, run_dir: str, config_path: str | None, overrides: list[str]) -> None:
    """The resolved config (and how it was asked for) next to the run's outputs."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(cfg.to_yaml())
    with open(os.path.join(run_dir, "command.json"), "w") as f:
        json.dump({"config": config_path, "overrides": list(overrides)}, f, indent=1)
