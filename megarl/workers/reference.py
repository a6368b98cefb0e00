"""ReferenceWorker: the frozen initial policy, for KL terms.

    ref = ReferenceWorker.from_config(cfg)
    ref_log_prob = ref.compute_ref_log_prob(batch, temperature=1.0)     # [B, R]

Where the model config makes the reference the actor's own base (ModelConfig.reference_is_base:
LoRA), its log-probs come from the actor's shards as they were before the model converters (LoRA:
every adapter off; `ReferenceWorker.base_of(actor, ...)`), so no second copy of the weights is built.

With ref.param_offload (or ref.megatron.param_offload) the weights wait in pinned host memory
between calls; on CPU they are there already, so the flag changes nothing (one warning says so).
"""
from __future__ import annotations

from megarl.parallel import state
from megarl.protocol import DataProto
from megarl.workers.actor import engine_spec
from megarl.workers.config import MegatronConfig, ModelConfig, RefConfig
from megarl.workers.engine import MegatronEngine
from megarl.workers.offload import offload_plan
from megarl.workers.outputs import log_prob_outputs


class ReferenceWorker:
    def __init__(self, model: ModelConfig, ref: RefConfig, micro_batch_size: int = 4, dtype: str = "auto"):
        self.cfg = ref
        self.micro = ref.log_prob_micro_batch_size_per_gpu or micro_batch_size
        self.engine = MegatronEngine(engine_spec(model, ref, trainable=False, dtype=dtype,
                                                 role="actor_rollout_ref.ref"))
        # a frozen role has only weights to move (its megatron section may be the actor's, grads and all)
        wants = ref.param_offload or bool(ref.megatron and ref.megatron.param_offload)
        mc = MegatronConfig(param_offload=wants)
        self.offload_kw = offload_plan(mc, "actor_rollout_ref.ref", False, self.engine.device)
        if self.offload_kw:
            self.engine.offload(**self.offload_kw)

    @classmethod
    def base_of(cls, actor, ref: RefConfig, micro_batch_size: int = 4) -> "ReferenceWorker":
        """The actor's base model as the reference: the actor's engine, its converters undone while
        it runs (its weights are the actor's, so ref.param_offload has nothing of its own to move)."""
        self = cls.__new__(cls)
        self.cfg, self.engine, self.offload_kw = ref, actor.engine, {}
        self.micro = ref.log_prob_micro_batch_size_per_gpu or micro_batch_size
        return self

    @classmethod
    def from_config(cls, cfg, actor=None) -> "ReferenceWorker":
        if cfg.model.reference_is_base:   # megarl/experiment.py refuses a layout or offload of its own
            return cls.base_of(actor, cfg.actor_rollout_ref.ref, cfg.actor.ppo_micro_batch_size_per_gpu)
        return cls(cfg.model, cfg.actor_rollout_ref.ref, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.dtype)

    def compute_ref_log_prob(self, data: DataProto, temperature: float = 1.0):
        eng = self.engine
        group = state.tp_group()

        def process(out, mb):
            return log_prob_outputs(out, mb, eng.head_weight(), eng.spec.vocab_size, eng.layout.tp_rank, group,
                                    temperature, False)

        budget = self.cfg.log_prob_max_token_len_per_gpu if self.cfg.log_prob_use_dynamic_bsz else None
        base = eng.converters.original(eng.models)       # a LoRA actor's base: its adapters off
        try:
            # R3: the reference replays the rollout's routes too (RefConfig.router_replay says why)
            routes = "replay" if self.cfg.router_replay.mode == "R3" else None
            with base:
                return eng.forward_rows(data, self.micro, process, ("log_probs",), max_tokens=budget,
                                        routes=routes)["log_probs"]
        finally:
            if self.offload_kw:
                eng.offload(**self.offload_kw)
