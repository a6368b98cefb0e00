"""The registered model families (megarl/models/families/__init__.py imports every family file,
each of which registers its ModelFamily here)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.models.families.base import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add `family`; its name, model_type and architectures must be new (a second claim on one
    architecture would make which family reads a checkpoint depend on import order)."""
    taken = {a for f in _FAMILIES.values() for a in f.architectures}
    if family.name in _FAMILIES or family.model_type in {f.model_type for f in _FAMILIES.values()} \
            or taken & set(family.architectures):
        raise ValueError(f"model family {family.name!r} claims a name, model_type or architecture already registered")
    _FAMILIES[family.name] = family
    return family


def get(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def names() -> list[str]:
    return sorted(_FAMILIES)


def architectures() -> dict[str, tuple[ModelFamily, str]]:
    """HF architecture -> (its family, its head "lm" | "score")."""
    return {arch: (f, head) for f in _FAMILIES.values() for arch, head in f.architectures.items()}


def for_model_type(model_type: str | None) -> ModelFamily | None:
    return next((f for f in _FAMILIES.values() if f.model_type == model_type), None)


def for_config(cfg: Mapping[str, Any]) -> tuple[ModelFamily, str, str]:
    """(family, architecture, head) of an HF config: its first registered architecture, or for a
    config written without `architectures`, its model_type's causal LM."""
    archs, known = cfg.get("architectures") or [], architectures()
    for arch in archs:
        if arch in known:
            return known[arch][0], arch, known[arch][1]
    family = for_model_type(cfg.get("model_type"))
    if not archs and family is not None:
        return family, family.default_architecture, family.architectures[family.default_architecture]
    named = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {named}; megarl supports {', '.join(sorted(known))}")
