"""Qwen3: no biases, an RMSNorm over each q and k head before RoPE (QkNorm, its code hooks:
megatron's q/k layernorm in the trainer, the same norm in the built-in engine)."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_BIAS, NO_SLIDING_WINDOW, ModelFamily, causal_and_score
from megarl.models.families.hooks import Dims, FamilyHooks, HookTensor, LayerTensors


class QkNorm(FamilyHooks):
    """q_norm / k_norm: one [head_dim] RMSNorm weight each, shared by all heads, replicated over TP."""

    def layer_tensors(self, dims: Dims, index: int) -> LayerTensors:
        hd = (dims.head_dim,)
        return {"self_attention.q_layernorm.weight": HookTensor("self_attn.q_norm.weight", hd),
                "self_attention.k_layernorm.weight": HookTensor("self_attn.k_norm.weight", hd)}

    def transformer_config(self, spec):
        return {"qk_layernorm": True}

    def layer_spec(self, layer, norm, index):
        # megarl's norm rather than megatron's torch one, which refuses sequence parallelism;
        # megatron sums the q/k norm grads over TP by parameter name either way.
        layer.submodules.self_attention.submodules.q_layernorm = norm
        layer.submodules.self_attention.submodules.k_layernorm = norm

    def native_qk(self, q, k, weights, norm, index):
        return norm(q, weights["self_attn.q_norm.weight"]), norm(k, weights["self_attn.k_norm.weight"])


QK_NORM = QkNorm()
FAMILY = register(ModelFamily(name="qwen3", model_type="qwen3", architectures=causal_and_score("Qwen3"),
                              hooks=QK_NORM, refused={**NO_BIAS, **NO_SLIDING_WINDOW}), module=__name__)
