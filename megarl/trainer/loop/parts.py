"""Build every part of a run from the config, on every rank.

    parts = build_parts(cfg, ranks, log)          # colocated: TrainerParts with the engine
    shared = build_shared(cfg, ranks, log)        # what every role needs (both placements)

Order matters for memory and for errors: the model checkpoint is created if asked (rank 0, the
others wait), its config is checked against the layout before any weights load, then the
megatron roles, the rollout engine and the weight sync are built. The parts of the two sides of
a disaggregated run are built in megarl/trainer/disaggregated.py from the same `build_shared`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from megarl.algos.kl import make_kl_controller
from megarl.checkpoint_engine import WeightSync, build_checkpoint_engine
from megarl.config import ConfigError
from megarl.experiment import read_hf_config
from megarl.config.model_path import model_path_state
from megarl.data.build import build_loaders
from megarl.config.plugins import load_object
from megarl.reward.manager import build_reward_manager
from megarl.rollout.build_args import pad_id
from megarl.rollout.multiturn import build_agent_loop, prompt_tool_schemas
from megarl.rollout.registry import build_rollout
from megarl.storage.durable import make_private_dir, write_durably
from megarl.workers.actor import ActorWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.reference import ReferenceWorker
from megarl.workers.reward_model import RewardModelWorker

if TYPE_CHECKING:       # annotations only
    from transformers import PreTrainedTokenizerBase

    from megarl.algos.kl import AdaptiveKLController, FixedKLController
    from megarl.data.loader import PromptLoader
    from megarl.reward.manager import RewardManager
    from megarl.rollout.base import RolloutEngine


@dataclass
class Shared:
    """What every role of a run needs, on every rank (build_shared)."""
    tokenizer: PreTrainedTokenizerBase
    pad_token_id: int
    train_loader: PromptLoader
    val_loader: PromptLoader | None
    total_steps: int


@dataclass
class TrainerParts(Shared):
    """The megatron roles and what feeds them: every rank of a colocated run, the trainer ranks
    of a disaggregated one (there `rollout` is None and `val_loader` is None: both live on the
    rollout ranks, and `weight_sync` is the sending half)."""
    actor: ActorWorker
    ref: ReferenceWorker | None            # None unless a KL term needs it
    critic: CriticWorker | None            # None unless the critic is on
    reward_model: RewardModelWorker | None  # None unless reward_model.enable
    rollout: RolloutEngine | None
    weight_sync: WeightSync                # ColocatedSync / DiskSync, or DisaggregatedSender
    reward: RewardManager | None           # rank 0 only; None elsewhere
    kl_ctrl: AdaptiveKLController | FixedKLController

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


@dataclass
class RolloutParts(Shared):
    """The rollout ranks of a disaggregated run: the engine and the receiving half of the sync."""
    rollout: RolloutEngine
    weight_sync: WeightSync                # DisaggregatedReceiver
    reward: RewardManager | None           # first rollout rank, for validation; None elsewhere


def ensure_model(cfg, ranks) -> dict:
    """Create the HF checkpoint with `model.bootstrap` when it is missing (global rank 0; every
    rank of the job waits), then check its config against the layout. Returns that config."""
    m = cfg.model
    if not m.path:
        raise ConfigError("no model: set actor_rollout_ref.model.path to an HF checkpoint directory",
                          "actor_rollout_ref.model.path")
    if ranks.global_rank == 0 and model_path_state(m.path, m.bootstrap) == "bootstrap":   # config/model_path.py's rules
        load_object(m.bootstrap, "actor_rollout_ref.model.bootstrap")(m.path, cfg, **m.bootstrap_kwargs)
    ranks.barrier_all()
    hf = read_hf_config(m.path)
    if hf is None:
        raise ConfigError(f"{m.path} still holds no config.json after bootstrap", "actor_rollout_ref.model.bootstrap")
    cfg.check_model(hf)
    return hf


def total_steps(cfg, loader) -> int:
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * loader.batches_per_epoch


def build_shared(cfg, ranks, log) -> Shared:
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


def build_roles(cfg, shared: Shared) -> dict:
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


def build_parts(cfg, ranks, log) -> TrainerParts:
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


def write_run_dir(cfg, run_dir: str, config_path: str | None, overrides: list[str]) -> None:
    """The resolved config (and how it was asked for) next to the run's outputs: mode 0600 whatever the
    umask, values read from the environment shown as `<from env NAME>` (megarl/config/interpolate.py)."""
    make_private_dir(run_dir)
    write_durably(os.path.join(run_dir, "config.yaml"), cfg.to_yaml())
    write_durably(os.path.join(run_dir, "command.json"),
                  json.dumps({"config": config_path, "overrides": list(overrides)}, indent=1))
