"""Qwen3-MoE: Qwen3's attention (q/k norm, no bias), every MLP a softmax top-k mixture of experts."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_BIAS, NO_SLIDING_WINDOW, ModelFamily, MoeMlp
from megarl.models.families.qwen3 import QK_NORM

# norm_topk_prob as the released models set it (Qwen3-30B-A3B: true).
FAMILY = register(ModelFamily(
    name="qwen3_moe", model_type="qwen3_moe", architectures={"Qwen3MoeForCausalLM": "lm"},
    hooks=QK_NORM, mlp=MoeMlp(), refused={**NO_BIAS, **NO_SLIDING_WINDOW},
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
          "router_aux_loss_coef": 0.01}), module=__name__)
