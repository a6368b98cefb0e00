"""Model converters: named transforms of a role's built model chunks, run after the weights are
loaded and before DDP and the optimizer wrap them, so whatever a converter adds, replaces or
freezes is what the optimizer sees (a LoRA or fp8 converter registers itself here).

    @register_converter("freeze_embeddings")
    def freeze_embeddings(options: dict) -> Converter:
        def convert(chunks: list[torch.nn.Module]) -> None:
            for m in chunks:
                if m.pre_process:
                    m.embedding.word_embeddings.weight.requires_grad_(False)
        return convert

    build_model_converters(["freeze_embeddings"]).convert(chunks)   # no names: nothing changes

Config: `actor_rollout_ref.model.converters` / `critic.model.converters`, a list of names or a
mapping name -> options (a converter's module is imported by `model.external_lib`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

Converter = Callable[[list[nn.Module]], None]          # changes the chunks in place
ConverterFactory = Callable[[dict[str, Any]], Converter]

_CONVERTERS: dict[str, ConverterFactory] = {}


def register_converter(name: str) -> Callable[[ConverterFactory], ConverterFactory]:
    def add(factory: ConverterFactory) -> ConverterFactory:
        if name in _CONVERTERS:
            raise ValueError(f"model converter {name!r} is already registered")
        _CONVERTERS[name] = factory
        return factory
    return add


def registered_converters() -> list[str]:
    return sorted(_CONVERTERS)


@dataclass(frozen=True)
class ModelConverters:
    """The configured converters, applied in the order the config names them."""
    steps: tuple[tuple[str, Converter], ...] = ()

    def convert(self, chunks: list[nn.Module]) -> None:
        for _, step in self.steps:
            step(chunks)


def build_model_converters(config: Sequence[str] | Mapping[str, Mapping[str, Any]] | None) -> ModelConverters:
    """Converters from their names (or name -> options); an unknown name is refused in one line."""
    named = dict(config) if isinstance(config, Mapping) else {name: {} for name in config or ()}
    unknown = [n for n in named if n not in _CONVERTERS]
    if unknown:
        raise ValueError(f"model.converters: unknown converter(s) {', '.join(unknown)}; registered: "
                         f"{', '.join(registered_converters()) or 'none'} (register one with "
                         "megarl.models.converters.register_converter, imported by model.external_lib)")
    return ModelConverters(tuple((n, _CONVERTERS[n](dict(opts or {}))) for n, opts in named.items()))
