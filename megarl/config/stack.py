"""megatron overrides that the installed stack cannot honour, named when the config is built.

    check_transformer_overrides(cfg)     # megarl/experiment.py RULES: before --check passes, before any rank starts

verl's MoE scripts set fused kernels through <role>.megatron.override_transformer_config. megatron-core
checks some of them only inside the first rank's model build (apply_rope_fusion raises there without
Transformer Engine), and takes others silently: megarl builds megatron's local layer spec, whose linear
layers ignore fp8. Each such key gets one line naming what would honour it.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable

from megarl.config.errors import ConfigError

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")

_TE = ("transformer_engine", "Transformer Engine (pip install transformer_engine[pytorch])")
_APEX = ("fused_weight_gradient_mlp_cuda", "apex's CUDA extension fused_weight_gradient_mlp_cuda (apex built with "
                                           "--cpp_ext --cuda_ext)")
_GROUPED = ("grouped_gemm", "the grouped_gemm package (megatron's GroupedMLP on megarl's local layer spec)")
_DEEP_EP = ("deep_ep", "DeepEP (the deep_ep package)")


def available(module: str) -> bool:
    """Whether `module` is importable here (tests replace this to take both branches)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# key -> (whether a value asks for the feature, what must be installed: (module, words), the value that needs
# nothing). Facts from megatron-core 0.16.1: transformer_config.py (rope fusion needs TE >= 1.4; permute
# fusion TE >= 2.1), tensor_parallel/layers.py (fused_weight_gradient_mlp_cuda), transformer/moe/
# grouped_gemm_util.py (grouped_gemm) and transformer/moe/fused_a2a.py (deep_ep).
NEEDS: dict[str, tuple[Callable[[Any], bool], tuple[str, str], str]] = {
    "apply_rope_fusion": (bool, _TE, "False"),
    "moe_permute_fusion": (bool, _TE, "False"),
    "gradient_accumulation_fusion": (bool, _APEX, "False"),
    "moe_grouped_gemm": (bool, _GROUPED, "False"),
    "moe_token_dispatcher_type": (lambda v: v == "flex", _DEEP_EP, "allgather"),
    "moe_enable_deepep": (bool, _DEEP_EP, "False"),
}

# Keys no installed package makes megarl honour: its local layer spec has no FP8/FP4 layers.
NEVER: dict[str, Callable[[Any], bool]] = {
    "fp8": lambda v: v is not None, "fp8_param": bool, "fp4": lambda v: v is not None, "fp4_param": bool,
}


def check_transformer_overrides(cfg: Any) -> None:
    """One line for the first override_transformer_config key this stack cannot honour."""
    for role in ROLES:
        node = cfg
        for part in role.split("."):
            node = getattr(node, part, None)
        overrides = getattr(getattr(node, "megatron", None), "override_transformer_config", None) or {}
        for key, value in overrides.items():
            where = f"{role}.megatron.override_transformer_config.{key}"
            if key in NEVER and NEVER[key](value):
                raise ConfigError(f"={value!r}: megarl builds megatron-core's local layer spec, whose layers compute "
                                  "in bf16 whatever fp8/fp4 say (no installed package changes that); remove the key",
                                  where)
            if key in NEEDS:
                asks, (module, words), off = NEEDS[key]
                if asks(value) and not available(module):
                    raise ConfigError(f"={value!r} needs {words}, which is not installed here; install it or set "
                                      f"{where}={off}", where)
