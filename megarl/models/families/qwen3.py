"""Qwen3: no biases, an RMSNorm over each q and k head before RoPE."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_BIAS, NO_SLIDING_WINDOW, ModelFamily, causal_and_score

FAMILY = register(ModelFamily(name="qwen3", model_type="qwen3", architectures=causal_and_score("Qwen3"),
                              qk_norm=True, refused={**NO_BIAS, **NO_SLIDING_WINDOW}), module=__name__)
