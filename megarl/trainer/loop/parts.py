"""What the loops run on: the parts of a run on one rank (the megatron roles, the rollout engine,
the weight sync, the data and the reward), as megarl/job/build.py builds them from the config.
The loops (megarl/trainer/loop/fit.py, megarl/trainer/stream/) read these and build nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # annotations only
    from transformers import PreTrainedTokenizerBase

    from megarl.algos.kl import AdaptiveKLController, FixedKLController
    from megarl.checkpoint_engine import WeightSync
    from megarl.data.loader import PromptLoader
    from megarl.reward.manager import RewardManager
    from megarl.rollout.base import RolloutEngine
    from megarl.workers.actor import ActorWorker
    from megarl.workers.critic import CriticWorker
    from megarl.workers.reference import ReferenceWorker
    from megarl.workers.reward_model import RewardModelWorker


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
