"""Code a family adds where ModelFamily's data fields cannot say it: a FamilyHooks subclass in the
family's file, set as `ModelFamily(hooks=...)`. The shared code calls each hook at one fixed point
and every default adds nothing, so a family overrides only what its blocks need (qwen3.py: an
RMSNorm over each q and k head). megarl's family files stay torch-free (the launcher reads them
before torch loads): hooks get torch objects passed in.

    hook                         called by                 what it says
    layer_tensors(dims)          convert.py, spec.py,      per-layer tensors past the shared ones:
                                 the built-in engine       megatron suffix -> (HF suffix, shape)
    transformer_config(spec)     build.py                  TransformerConfig keys
    layer_spec(layer, norm)      build.py                  edits megatron's local layer spec
    native_qk(q, k, w, norm)     the built-in engine       q, k of each head, before RoPE

Tensors from layer_tensors are held whole by every tensor-parallel rank (norms, gates, small
projections): convert.py maps them one to one, the engine loads them beside its own, and the
parameter count includes them. Their megatron names must not look TP-split to convert.tp_dim
(`self_attention.linear_qkv*`, `*linear_fc1.weight`, `*linear_fc2.weight`, `linear_proj`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

# megatron suffix under decoder.layers.N. -> (HF suffix under model.layers.N., full shape)
LayerTensors = dict[str, tuple[str, tuple[int, ...]]]


class Dims(Protocol):
    """The sizes a hook reads: ModelSpec (trainer side) and ModelArgs (built-in engine) both have them."""
    @property
    def hidden_size(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class FamilyHooks:
    """Every hook of a family; a family's subclass overrides the ones it needs."""

    def layer_tensors(self, dims: Dims) -> LayerTensors:
        """Per-layer tensors every TP rank holds whole, past the shared attention, norms and MLP."""
        return {}

    def transformer_config(self, spec: Any) -> dict[str, Any]:
        """megatron TransformerConfig keys for `spec` (a ModelSpec), applied before the user's overrides."""
        return {}

    def layer_spec(self, layer: Any, norm: Any) -> None:
        """Edit megatron's local layer spec `layer` (a ModuleSpec) in place; `norm` is megarl's norm
        class for this run (it supports sequence parallelism, megatron's torch norm does not)."""

    def native_qk(self, q: Any, k: Any, weights: Mapping[str, Any], norm: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
        """The built-in engine's q [..., heads, hd] and k [..., kv_heads, hd] after the QKV
        projection, before RoPE; `weights`: this layer's layer_tensors keyed by HF suffix;
        `norm(x, weight)`: the engine's RMSNorm over the last dim, computed as transformers does."""
        return q, k


NO_HOOKS = FamilyHooks()
