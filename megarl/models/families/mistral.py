"""Mistral: Llama's layers with a sliding attention window, honoured by refusing runs whose
sequences could exceed it (megatron's local spec attends over the full context)."""
from megarl.models.families.registry import register
from megarl.models.families.base import NO_BIAS, ModelFamily, causal_and_score

FAMILY = register(ModelFamily(name="mistral", model_type="mistral", architectures=causal_and_score("Mistral"),
                              sliding_window=True, refused=NO_BIAS, tiny={"sliding_window": 4096}), module=__name__)
