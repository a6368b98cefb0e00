"""CriticWorker: the actor's backbone with a scalar value head.

    critic = CriticWorker.from_config(cfg)
    values = critic.compute_values(batch)                 # [B, R]: V(state before responses[:, j])
    metrics = critic.update_critic(batch, loss_fn)        # loss_fn gets outputs {"values": [b, R]}

Initialised from the actor's HF checkpoint with the head at zero (critic.model.init_from=actor),
or from a reward model whose `score.weight` becomes the head (init_from=path, a
*ForSequenceClassification checkpoint with one label).
"""
from __future__ import annotations

from megarl.protocol import DataProto
from megarl.workers.actor import engine_spec
from megarl.workers.config import CriticConfig
from megarl.workers.engine import EngineShardView, MegatronEngine
from megarl.workers.offload import RoleMemory, offload_plan
from megarl.workers.outputs import value_outputs


class CriticWorker(EngineShardView, RoleMemory):
    def __init__(self, critic: CriticConfig, rollout_n: int = 1, dtype: str = "auto",
                 log_prob_micro_batch_size: int | None = None):
        if critic.ppo_mini_batch_size is None or (critic.ppo_micro_batch_size_per_gpu is None
                                                  and not critic.use_dynamic_bsz):
            raise ValueError("critic.ppo_mini_batch_size and ppo_micro_batch_size_per_gpu are unset; build the "
                             "critic from an ExperimentConfig (which copies the actor's) or set them")
        self.cfg = critic
        self.rollout_n = rollout_n
        self.forward_micro = log_prob_micro_batch_size or critic.ppo_micro_batch_size_per_gpu
        self.engine = MegatronEngine(engine_spec(
            critic.model, critic, head="value", trainable=True, optim=critic.optim, dtype=dtype,
            head_from_checkpoint=critic.model.init_from == "path", role="critic"))
        self.offload_kw = offload_plan(critic.megatron, "critic", True, self.engine.device)

    @classmethod
    def from_config(cls, cfg) -> "CriticWorker":
        return cls(cfg.critic, cfg.rollout.n, cfg.actor.dtype,
                   cfg.actor.log_prob_micro_batch_size_per_gpu)

    def compute_values(self, data: DataProto):
        budget = self.cfg.forward_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None
        return self.engine.forward_rows(data, self.forward_micro, value_outputs, ("values",),
                                        max_tokens=budget)["values"]

    def update_critic(self, data: DataProto, loss_fn) -> dict[str, float]:
        mini = self.cfg.ppo_mini_batch_size * self.rollout_n
        return self.engine.train(data, mini, self.cfg.ppo_micro_batch_size_per_gpu, self.cfg.ppo_epochs or 1,
                                 value_outputs, loss_fn, "critic",
                                 max_tokens=self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None)

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)

    def hf_tensors(self):
        """The critic as an HF *ForSequenceClassification model's tensors (head as `score.weight`)."""
        return self.engine.hf_tensors()
