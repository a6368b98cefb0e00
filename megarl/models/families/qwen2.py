"""Qwen2: Llama's layers with a bias on the q/k/v projections."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_SLIDING_WINDOW, ModelFamily, causal_and_score

FAMILY = register(ModelFamily(name="qwen2", model_type="qwen2", architectures=causal_and_score("Qwen2"),
                              qkv_bias=True, refused=NO_SLIDING_WINDOW), module=__name__)
