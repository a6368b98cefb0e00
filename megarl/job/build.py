"""Build every part of a run from the config, on every rank.

    parts = build_parts(cfg, ranks, log)            # colocated: TrainerParts with the engine
    parts = build_trainer_parts(cfg, ranks, log)    # disaggregated, trainer ranks: roles + weight sender
    parts = build_rollout_parts(cfg, ranks, log)    # disaggregated, rollout ranks: engine + receiver (+ val reward)
    shared = build_shared(cfg, ranks, log)          # what every role needs (each of the above starts here)

Order matters for memory and for errors: the model checkpoint is created if asked (rank 0, the
others wait), its config is checked against the layout before any weights load, then the
megatron roles, the rollout engine and the weight sync are built.
"""
from __future__ import annotations

import json
import os

from transformers import AutoTokenizer

from megarl.algos.kl import make_kl_controller
from megarl.checkpoint_engine import build_checkpoint_engine
from megarl.config import ConfigError
from megarl.config.model_path import model_path_state
from megarl.config.plugins import load_object
from megarl.data.build import build_loaders
from megarl.experiment import ExperimentConfig
from megarl.models.hf_config import find_hf_config
from megarl.reward.manager import build_reward_manager
from megarl.rollout.build_args import pad_id
from megarl.rollout.multiturn import build_agent_loop, prompt_tool_schemas
from megarl.rollout.registry import build_rollout
from megarl.storage.durable import make_private_dir, write_durably
from megarl.trainer.loop.parts import RolloutParts, Shared, TrainerParts
from megarl.workers.actor import ActorWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.reference import ReferenceWorker
from megarl.workers.reward_model import RewardModelWorker


def ensure_model(cfg: ExperimentConfig, ranks) -> dict:
    """Create the HF checkpoint with `model.bootstrap` when it is missing (global rank 0; every
    rank of the job waits), then check its config against the layout. Returns that config."""
    m = cfg.model
    if not m.path:
        raise ConfigError("no model: set actor_rollout_ref.model.path to an HF checkpoint directory",
                          "actor_rollout_ref.model.path")
    if ranks.global_rank == 0 and model_path_state(m.path, m.bootstrap) == "bootstrap":   # config/model_path.py's rules
        load_object(m.bootstrap, "actor_rollout_ref.model.bootstrap")(m.path, cfg, **m.bootstrap_kwargs)
    ranks.barrier_all()
    hf = find_hf_config(m.path)
    if hf is None:
        raise ConfigError(f"{m.path} still holds no config.json after bootstrap", "actor_rollout_ref.model.bootstrap")
    cfg.check_model(hf)
    return hf


def total_steps(cfg: ExperimentConfig, loader) -> int:
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * loader.batches_per_epoch


def build_shared(cfg: ExperimentConfig, ranks, log) -> Shared:
    """The checkpoint (created and checked), the tokenizer, the data loaders and the step count."""
    ensure_model(cfg, ranks)
    m = cfg.model
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    train_loader, val_loader = build_loaders(cfg.data, tokenizer, prompt_tool_schemas(cfg, tokenizer))
    for loader in (train_loader, val_loader):
        summary = getattr(getattr(loader, "dataset", None), "summary", None)
        if summary is not None and log is not None:
            log.info(f"megarl: {summary()}")
    return Shared(tokenizer, pad_id(tokenizer), train_loader, val_loader, total_steps(cfg, train_loader))


def build_roles(cfg: ExperimentConfig, shared: Shared) -> dict:
    """The megatron roles, each from the run's resolved config (its own optimizer step count)."""
    # A run of 0 steps (total_training_steps=0) never steps its optimizers, but their schedules are
    # built (and a decaying one needs a length): one step long, which no update reaches.
    run_cfg = cfg.resolved(max(shared.total_steps, 1))
    needs_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    actor = ActorWorker.from_config(run_cfg)
    roles = dict(actor=actor, ref=ReferenceWorker.from_config(run_cfg, actor) if needs_ref else None,
                 critic=CriticWorker.from_config(run_cfg) if cfg.critic.enable else None, reward_model=None)
    if cfg.reward_model.enable:
        roles["reward_model"] = RewardModelWorker.from_config(run_cfg)
    return roles


def build_parts(cfg: ExperimentConfig, ranks, log) -> TrainerParts:
    shared = build_shared(cfg, ranks, log)
    roles = build_roles(cfg, shared)
    rollout = build_rollout(cfg.rollout, cfg.model.path, shared.tokenizer, tp_group=ranks.rollout_group,
                            device=ranks.device, override_config=cfg.model.override_config)
    if cfg.rollout.multi_turn.enable:
        rollout = build_agent_loop(cfg, rollout, shared.tokenizer)
    weight_sync = build_checkpoint_engine(cfg, roles["actor"], rollout, ranks.rollout_group)
    reward = build_reward_manager(cfg, shared.tokenizer) if ranks.is_main else None
    return TrainerParts(**vars(shared), **roles, rollout=rollout, weight_sync=weight_sync, reward=reward,
                        kl_ctrl=make_kl_controller(cfg.algorithm.kl_ctrl))


def write_run_dir(cfg: ExperimentConfig, run_dir: str, config_path: str | None, overrides: list[str]) -> None:
    """The resolved config (and how it was asked for) next to the run's outputs: mode 0600 whatever the
    umask, values read from the environment shown as `<from env NAME>` (megarl/config/interpolate.py)."""
    make_private_dir(run_dir)
    write_durably(os.path.join(run_dir, "config.yaml"), cfg.to_yaml())
    write_durably(os.path.join(run_dir, "command.json"),
                  json.dumps({"config": config_path, "overrides": list(overrides)}, indent=1))


def build_trainer_parts(cfg: ExperimentConfig, ranks, log) -> TrainerParts:
    shared = build_shared(cfg, ranks, log)
    shared.val_loader = None                  # validation runs on the rollout ranks
    roles = build_roles(cfg, shared)
    sender = build_checkpoint_engine(cfg, roles["actor"], side=ranks.role, sync_groups=ranks.sync_groups,
                                     device=ranks.device, say=log.info)
    reward = build_reward_manager(cfg, shared.tokenizer) if ranks.is_main else None
    return TrainerParts(**vars(shared), **roles, rollout=None, weight_sync=sender, reward=reward,
                        kl_ctrl=make_kl_controller(cfg.algorithm.kl_ctrl))


def build_rollout_parts(cfg: ExperimentConfig, ranks, log) -> RolloutParts:
    shared = build_shared(cfg, ranks, log)
    engine = build_rollout(cfg.rollout, cfg.model.path, shared.tokenizer, tp_group=ranks.rollout_group,
                           device=ranks.device, override_config=cfg.model.override_config)
    receiver = build_checkpoint_engine(cfg, rollout=engine, side=ranks.role, sync_groups=ranks.sync_groups,
                                       device=ranks.device)
    reward = build_reward_manager(cfg, shared.tokenizer) if ranks.is_main and shared.val_loader is not None else None
    return RolloutParts(**vars(shared), rollout=engine, weight_sync=receiver, reward=reward)
