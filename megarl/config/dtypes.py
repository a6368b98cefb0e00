"""The one table of dtype names a config may write, without torch (the launcher reads it too).

    canonical("bf16")    -> "bfloat16"   (torch's own name: getattr(torch, canonical(x)) is the dtype)
    short("bfloat16")    -> "bf16"       (what log lines and messages print)
"""
from __future__ import annotations

_CANONICAL = {"float32": "float32", "fp32": "float32", "float": "float32",
              "bfloat16": "bfloat16", "bf16": "bfloat16",
              "float16": "float16", "fp16": "float16", "half": "float16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NAMES = "float32, bfloat16 or float16"             # for messages


def canonical(name: str) -> str | None:
    """torch's name for a dtype spelling (fp32, bf16, half, ...), or None for anything else."""
    return _CANONICAL.get(name)


def short(name: str) -> str:
    """fp32 / bf16 / fp16 for a canonical name (other names unchanged)."""
    return _SHORT.get(name, name)
