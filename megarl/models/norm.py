"""The layer norm of megarl's layer spec: RMSNorm that also runs under sequence parallelism.

megatron-core's local-spec norm (`WrappedTorchNorm`) refuses `sequence_parallel=True`, although
RMSNorm and LayerNorm act on each token alone, so a rank holding s/TP tokens computes exactly its
part of the result. What sequence parallelism does change is the gradient of the norm's weight:
each TP rank sees only its tokens, so the weight's gradient must be summed over the TP group.
megatron's `finalize_model_grads` does that for every parameter tagged `sequence_parallel=True`
(`_allreduce_non_tensor_model_parallel_grads`); this module sets the tag.

    norm = Norm(config, hidden_size, eps)     # as a ModuleSpec entry: input_layernorm=Norm

With `override_transformer_config.transformer_impl=transformer_engine` (and TE importable),
`norm_class(config)` picks TE's `TENorm` instead, which supports sequence parallelism itself and
keeps the `.weight` name megarl's conversion maps. That branch has NOT run (no CUDA and no TE on
the machine this was written on); the default is megarl's torch norm on every device.
"""
from __future__ import annotations

import torch


class Norm:
    """Builds torch's RMSNorm (or LayerNorm) for a megatron ModuleSpec slot; weights tagged for SP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by megarl's local norm")
        kind = config.normalization
        if kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization={kind!r}: megarl's local norm supports RMSNorm and LayerNorm")
        device = "cpu" if config.use_cpu_initialization else None
        norm_cls = torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        for p in norm.parameters():
            # Read by megatron's finalize_model_grads: sum this gradient over TP when SP is on.
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def norm_class(config):
    """TENorm when the config asks for Transformer Engine, else megarl's `Norm`."""
    if getattr(config, "transformer_impl", "local") != "transformer_engine":
        return Norm
    try:
        from megatron.core.extensions.transformer_engine import TENorm  # optional extra megarl[te]
    except ImportError as err:
        raise ValueError("override_transformer_config.transformer_impl=transformer_engine needs "
                         "transformer_engine installed; remove the override to use megarl's torch norm") from err
    return TENorm
