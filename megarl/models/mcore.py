"""What megarl needs from megatron-core, checked by feature rather than by version number.

    mcore.require()          # once per process before building a model: ImportError naming what is missing
    mcore.version()          # (0, 16, 1)
    mcore.HAS_HYBRID_MODEL   # megatron.core.models.hybrid exists (0.18 and later)
    mcore.fingerprint(fn)    # sha256 of a megatron function's AST: is it the source a patch was written for?

Supported: 0.16.1 (CI, Python 3.11) up to 0.19.x (Python >= 3.12). The interfaces megarl calls
(parallel_state with CP/VPP, get_num_layers_to_build / get_transformer_layer_offset with vp_stage,
TransformerBlockSubmodules, the core-attention constructor, finalize_model_grads and its
`sequence_parallel` tag, dist_checkpointing, the interleaved schedule) have the same signatures
in 0.16.1, 0.17.1, 0.18.2 and 0.19.0 (read from Megatron-LM's core_v* tags). What differs:
  * 0.19 logs "GPTModel IS DEPRECATED" in favour of HybridModel (0.18+). megarl still builds
    GPTModel on every version: HybridModel splits each GPT layer into an attention layer and an MLP
    layer (pattern "*-" per layer), which renames every layer parameter megarl's conversion maps
    and checkpoints use. The move is planned in docs/models.md ("megatron-core versions").
  * 0.19's synchronous dist-checkpoint save runs through its own deprecated "mcore" async path and
    logs "MCore's async save is deprecated"; megarl saves synchronously and has nothing to move.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import textwrap

from megatron.core import package_info
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from megatron.core.transformer import transformer_block, transformer_layer

HAS_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None


def version() -> tuple[int, ...]:
    return (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def fingerprint(fn) -> str:
    """16 hex digits of the sha256 of `fn`'s AST (comments and layout do not count), or "no
    source"; functools.wraps wrappers are followed back to the wrapped function."""
    fn = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):   # built without readable source: cannot be the checked one
        return "no source"
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def missing() -> list[str]:
    """The features megarl uses that this megatron-core lacks (empty when all are there)."""

    gaps = []
    checks = {
        "initialize_model_parallel(context_parallel_size, virtual_pipeline_model_parallel_size)":
            (ps.initialize_model_parallel, ("context_parallel_size", "virtual_pipeline_model_parallel_size")),
        "get_num_layers_to_build(config, vp_stage)": (transformer_block.get_num_layers_to_build, ("vp_stage",)),
        "get_transformer_layer_offset(config, vp_stage)": (transformer_layer.get_transformer_layer_offset,
                                                           ("vp_stage",)),
        "is_pipeline_first_stage(ignore_virtual, vp_stage)": (ps.is_pipeline_first_stage,
                                                              ("ignore_virtual", "vp_stage")),
        "GPTModel(vp_stage)": (GPTModel.__init__, ("vp_stage",)),
    }
    for name, (fn, params) in checks.items():
        have = inspect.signature(fn).parameters
        if not all(p in have for p in params):
            gaps.append(name)
    if not hasattr(transformer_block, "TransformerBlockSubmodules"):
        gaps.append("TransformerBlockSubmodules")
    if not hasattr(CudaRNGStatesTracker, "fork"):
        gaps.append("CudaRNGStatesTracker.fork")
    return gaps


_CHECKED = False


def require() -> None:
    global _CHECKED
    if _CHECKED:
        return
    gaps = missing()
    if gaps:
        raise ImportError(f"megatron-core {'.'.join(map(str, version()))} lacks what megarl uses: {', '.join(gaps)}; "
                          "megarl supports megatron-core 0.16.1 to 0.19.x")
    _CHECKED = True
