"""Llama: dense SwiGLU, no biases, RoPE (default, linear or llama3 scaling)."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_BIAS, ModelFamily, causal_and_score

FAMILY = register(ModelFamily(name="llama", model_type="llama", architectures=causal_and_score("Llama"),
                              refused=NO_BIAS), module=__name__)
