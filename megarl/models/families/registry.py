"""The registered model families: every module of this package but base.py, hooks.py and this one is a family,
found by its file name (the shared registry shape, megarl/config/registry.py) and loaded when the
families are first read; a user's family registers itself here (docs/extending.md)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.config.registry import Registry, package_modules
from megarl.models.families.base import ModelFamily

# megarl's families: one module each in this package, holding its ModelFamily as FAMILY
_NOT_FAMILIES = ("base", "hooks", "registry")
FAMILIES = Registry("model family", "config.json's architectures", {
    name: f"{module}:FAMILY" for name, module in package_modules(__package__).items() if name not in _NOT_FAMILIES})


def _all() -> list[ModelFamily]:
    FAMILIES.load_builtins()
    return [FAMILIES.get(n) for n in FAMILIES.names()]


def register(family: ModelFamily, module: str | None = None) -> ModelFamily:
    """Add `family`; its name, model_type and architectures must be new (a second claim on one
    architecture would make which family reads a checkpoint depend on import order). megarl's own
    family modules pass their `__name__`; a user's family is checked against every built-in."""
    loaded = [FAMILIES.loaded(n) for n in FAMILIES.names()] if module else _all()
    others: list[ModelFamily] = [f for f in loaded if f is not None]
    taken = {a for f in others for a in f.architectures}
    if family.name in {f.name for f in others} or family.model_type in {f.model_type for f in others} \
            or taken & set(family.architectures):
        raise ValueError(f"model family {family.name!r} claims a name, model_type or architecture already registered")
    FAMILIES.add(family.name, family, origin=module or f"{family.name} (a family of your own)")
    return family


def unregister(name: str) -> None:
    FAMILIES.unregister(name)


def get(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(names())}")
    return FAMILIES.get(name)


def names() -> list[str]:
    return FAMILIES.names()


def architectures() -> dict[str, tuple[ModelFamily, str]]:
    """HF architecture -> (its family, its head "lm" | "score")."""
    return {arch: (f, head) for f in _all() for arch, head in f.architectures.items()}


def for_model_type(model_type: str | None) -> ModelFamily | None:
    return next((f for f in _all() if f.model_type == model_type), None)


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
