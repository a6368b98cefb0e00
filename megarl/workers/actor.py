"""ActorWorker: the policy's megatron shards; log-probs and PPO-style updates.

    actor = ActorWorker.from_config(cfg)                       # every rank, after init_distributed
    log_probs, entropy = actor.compute_log_prob(batch, temperature=1.0)          # [B, R] each
    metrics = actor.update_policy(batch, loss_fn, temperature=1.0)
    actor.save_checkpoint("runs/x/step_10/actor"); actor.load_checkpoint(...)

Every rank passes the same full batch and gets full-batch results back. `loss_fn(outputs,
micro_batch) -> (loss, metrics)` gets outputs {"log_probs", "entropy"} [b, R] (the entropy with
gradients only when actor.entropy_coeff != 0; otherwise it is a metric), and
meta_info["global_tokens"] / ["global_seqs"] / ["global_micro_batches"] of its mini-batch to
normalise by: the applied gradient is the sum of d(loss) over all micro-batches and DP ranks
(megarl/workers/engine.py), so `(x * mask).sum() / global_tokens` is an exact token mean. Metrics
are means over the micro-batch (verl's convention): the worker averages them over micro-batches,
DP ranks and mini-batches, and adds actor/grad_norm, actor/lr, actor/skipped_steps.
"""
from __future__ import annotations

import torch

from megarl.models.routing_replay import KEY as ROUTES
from megarl.parallel import state
from megarl.protocol import DataProto
from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, recompute_overrides
from megarl.workers.engine import EngineShardView, EngineSpec, MegatronEngine
from megarl.workers.offload import RoleMemory, offload_plan
from megarl.workers.outputs import log_prob_outputs


def engine_spec(model: ModelConfig, role_cfg, *, head: str = "lm", trainable: bool, optim=None, dtype: str = "auto",
                head_from_checkpoint: bool = False, role: str) -> EngineSpec:
    mc = role_cfg.megatron or MegatronConfig()
    return EngineSpec(
        model_path=model.path, tp=mc.tensor_model_parallel_size, pp=mc.pipeline_model_parallel_size,
        ep=mc.expert_model_parallel_size, etp=mc.expert_tensor_parallel_size, head=head,
        head_from_checkpoint=head_from_checkpoint, trainable=trainable, optim=optim, dtype=dtype,
        override_config=dict(model.override_config), dist_checkpoint=mc.dist_checkpointing_path,
        use_distributed_optimizer=_distributed_optimizer(mc), sequence_parallel=mc.sequence_parallel_on,
        cp=mc.context_parallel_size, vpp=mc.virtual_pipeline_model_parallel_size,
        recompute=model.enable_gradient_checkpointing,
        transformer_overrides={**recompute_overrides(model.gradient_checkpointing_kwargs),
                               **mc.override_transformer_config},
        ddp_overrides=dict(mc.override_ddp_config),
        converters=converter_config(model),
        # Packed (THD) micro-batches need per-sequence attention; the context-parallel attention
        # splits padded rows only, so CP runs padded.
        packing=model.use_remove_padding and mc.context_parallel_size == 1,
        # MoE routing replay (actor / reference router_replay.mode; the critic routes itself)
        routing_replay=getattr(getattr(role_cfg, "router_replay", None), "mode", "disabled") != "disabled",
        seed=mc.seed, role=role)


def converter_config(model: ModelConfig) -> dict[str, dict]:
    """The role's model converters, name -> options (ModelConfig.converter_options)."""
    return model.converter_options()


def _distributed_optimizer(mc) -> bool:
    """verl's default: the distributed optimizer wherever megatron's optimizer runs (CUDA)."""
    if mc.use_distributed_optimizer is None:
        return torch.cuda.is_available()
    return mc.use_distributed_optimizer


class ActorWorker(EngineShardView, RoleMemory):
    def __init__(self, model: ModelConfig, actor: ActorConfig, rollout_n: int = 1,
                 log_prob_max_tokens: int | None = None):
        self.cfg = actor
        self.rollout_n = rollout_n
        self.log_prob_max_tokens = log_prob_max_tokens  # rollout.log_prob_max_token_len_per_gpu when dynamic
        self.engine = MegatronEngine(engine_spec(model, actor, trainable=True, optim=actor.optim, dtype=actor.dtype,
                                                 role="actor_rollout_ref.actor"))
        self.offload_kw = offload_plan(actor.megatron, "actor_rollout_ref.actor", True, self.engine.device)

    @classmethod
    def from_config(cls, cfg) -> "ActorWorker":
        ro = cfg.rollout
        return cls(cfg.model, cfg.actor, ro.n,
                   ro.log_prob_max_token_len_per_gpu if ro.log_prob_use_dynamic_bsz else None)

    def _process(self, temperature: float, with_entropy: bool, entropy_grad: bool = False):
        eng = self.engine
        group = state.tp_group()
        return lambda out, mb: log_prob_outputs(out, mb, eng.head_weight(), eng.spec.vocab_size, eng.layout.tp_rank,
                                                group, temperature, with_entropy, entropy_grad,
                                                1.0 / eng.layout.cp)

    # -- the contract -------------------------------------------------------------------------------
    def compute_log_prob(self, data: DataProto, temperature: float = 1.0, with_entropy: bool = True,
                         record_routes: bool = False):
        """(log_probs [B, R], entropy [B, R] or None): log_softmax(logits / T) of each response token
        at position prompt_lens - 1 + j; 0 past response_lens. MoE routing replay
        (actor.router_replay.mode): R3 replays the batch's routed_experts; R2 with
        record_routes=True (the old-policy pass) returns a third item, the routes it took
        [B, S, L, K], for the update to replay."""
        keys = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        micro = self.cfg.log_prob_micro_batch_size_per_gpu or self.cfg.ppo_micro_batch_size_per_gpu
        mode = self.cfg.router_replay.mode
        if record_routes and mode != "R2":
            raise ValueError(f"record_routes needs actor.router_replay.mode=R2, not {mode}")
        routes = "record" if record_routes else ("replay" if mode == "R3" else None)
        rows = self.engine.forward_rows(data, micro, self._process(temperature, with_entropy), keys,
                                        max_tokens=self.log_prob_max_tokens, routes=routes)
        if record_routes:
            return rows["log_probs"], rows.get("entropy"), rows[ROUTES]
        return rows["log_probs"], rows.get("entropy")

    def update_policy(self, data: DataProto, loss_fn, temperature: float = 1.0,
                      with_entropy: bool = True) -> dict[str, float]:
        mini = self.cfg.ppo_mini_batch_size * self.rollout_n
        # The entropy is a metric unless it is in the loss: no gradient (and no backward work) then.
        process = self._process(temperature, with_entropy, entropy_grad=self.cfg.entropy_coeff != 0)
        # R2 and R3 alike: every update micro-batch replays the batch's routes.
        routes = None if self.cfg.router_replay.mode == "disabled" else "replay"
        return self.engine.train(data, mini, self.cfg.ppo_micro_batch_size_per_gpu, self.cfg.ppo_epochs, process,
                                 loss_fn, "actor", self.cfg.shuffle,
                                 self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None, routes)

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)

    def hf_tensors(self):
        return self.engine.hf_tensors()
