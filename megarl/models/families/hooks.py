"""Code a family adds where ModelFamily's data fields cannot say it: a FamilyHooks subclass in the
family's file, set as `ModelFamily(hooks=...)`. The shared code calls each hook at one fixed point
and every default adds nothing, so a family overrides only what its blocks need (qwen3.py: an
RMSNorm over each q and k head). megarl's family files stay torch-free (the launcher reads them
before torch loads): hooks get torch objects passed in.

    hook                            called by                 what it says
    layer_tensors(dims, index)      convert.py, spec.py,      layer `index`'s tensors past the shared
                                    the built-in engine       ones: megatron suffix -> HookTensor
    transformer_config(spec)        build.py                  TransformerConfig keys
    layer_spec(layer, norm, index)  build.py                  edits layer `index`'s local layer spec
    native_qk(q, k, w, norm, index) the built-in engine       q, k of each head, before RoPE

`index` is the layer's global number (0-based, over every pipeline stage), so a hybrid model (a
norm, a tensor or a megatron module on some layers only) says per layer what differs; the built-in
engine's attention itself (causal SDPA) is the same in every layer. A HookTensor
is held whole by every tensor-parallel rank (split=None: norms, gates) or split evenly along dim
`split` (an MLA-style up-projection): convert.py slices and joins it, the checkpoint engine's
plan gathers it, the built-in engine loads this rank's part. A megatron name that the shared rules
read as TP-split (`linear_qkv`, `linear_proj`, `linear_fc1/2`) or as whole (the layer norms) must
be declared that way: convert.check_hook_tensors refuses a disagreement in one line.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol


class HookTensor(NamedTuple):
    """One per-layer tensor: its HF suffix under model.layers.N., its full shape, and the dim it is
    split along over tensor-parallel ranks (None: every rank holds it whole)."""
    hf: str
    shape: tuple[int, ...]
    split: int | None = None


# megatron suffix under decoder.layers.N. -> its HookTensor
LayerTensors = dict[str, HookTensor]


class Dims(Protocol):
    """The sizes a hook reads: ModelSpec (trainer side) and ModelArgs (built-in engine) both have them."""
    @property
    def hidden_size(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class FamilyHooks:
    """Every hook of a family; a family's subclass overrides the ones it needs."""

    def layer_tensors(self, dims: Dims, index: int) -> LayerTensors:
        """Layer `index`'s tensors past the shared attention, norms and MLP."""
        return {}

    def transformer_config(self, spec: Any) -> dict[str, Any]:
        """megatron TransformerConfig keys for `spec` (a ModelSpec), applied before the user's overrides."""
        return {}

    def layer_spec(self, layer: Any, norm: Any, index: int) -> None:
        """Edit megatron's local layer spec `layer` (a ModuleSpec, layer `index`'s own copy) in place;
        `norm` is megarl's norm class for this run (it supports sequence parallelism, megatron's
        torch norm does not)."""

    def native_qk(self, q: Any, k: Any, weights: Mapping[str, Any], norm: Callable[[Any, Any], Any],
                  index: int) -> tuple[Any, Any]:
        """The built-in engine's q [..., heads, hd] and k [..., kv_heads, hd] (this TP rank's heads)
        of layer `index` after the QKV projection, before RoPE; `weights`: the layer's layer_tensors
        keyed by HF suffix (a split one: this rank's part);
        `norm(x, weight)`: the engine's RMSNorm over the last dim, computed as transformers does."""
        return q, k


NO_HOOKS = FamilyHooks()
