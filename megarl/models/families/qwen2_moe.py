"""Qwen2-MoE: Qwen2's attention (q/k/v bias), every MLP a softmax top-k mixture of experts plus a
shared expert scaled by a sigmoid gate."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_SLIDING_WINDOW, ModelFamily, MoeMlp

# norm_topk_prob as the released models set it (Qwen1.5/2-MoE: false).
FAMILY = register(ModelFamily(
    name="qwen2_moe", model_type="qwen2_moe", architectures={"Qwen2MoeForCausalLM": "lm"},
    qkv_bias=True, mlp=MoeMlp(shared_expert=True), refused=NO_SLIDING_WINDOW,
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "router_aux_loss_coef": 0.01}),
    module=__name__)
