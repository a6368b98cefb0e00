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

A converter that adds parameters or changes what the weights mean returns a ConverterHooks
instead of a plain function: the rest of megarl (the HF export, the weight sync's reader, the
reference policy, the checkpoint) asks the built ModelConverters, never a converter by name.

Config: `actor_rollout_ref.model.converters` / `critic.model.converters`, a list of names or a
mapping name -> options (a converter's module is imported by `model.external_lib`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megarl.models.converter_registry import CONVERTERS

Converter = Callable[[list[nn.Module]], None]          # changes the chunks in place
ConverterFactory = Callable[[dict[str, Any]], Converter]
Exports = dict[str, Callable[[], torch.Tensor]]        # local weight name -> its value, computed when read



class ConverterHooks:
    """A converter with more to say than its change to the chunks; every hook defaults to "nothing"."""

    def __call__(self, chunks: list[nn.Module]) -> None:
        raise NotImplementedError

    def added(self, name: str) -> bool:
        """Whether a (local) parameter name is one this converter added: not the model's own, so no
        HF name, never exported or synced as a weight of its own."""
        return False

    def exported(self, chunk: nn.Module) -> Exports:
        """{local weight name: () -> the value an HF export or a weight sync holds for it} for the
        weights whose exported value is not the parameter itself (LoRA: W + scale B A)."""
        return {}

    def original(self, chunks: list[nn.Module]) -> contextlib.AbstractContextManager:
        """The chunks as they were before this converter, for the duration (LoRA: adapters off)."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class Registration:
    factory: ConverterFactory
    # Converters whose options shape the checkpoint (parameters added): a step saved with other
    # options is refused in one line, "saved with <label> ...; <fix>".
    label: str | None = None
    fix: str = "configure model.converters as at the save"


def register_converter(name: str, checkpoint_label: str | None = None, fix: str | None = None,
                       options: type | None = None) -> Callable[[ConverterFactory], ConverterFactory]:
    """`options`: the Section dataclass of the keys model.converters.<name> may give; the factory then
    gets an instance of it (typed, checked at --check) instead of the plain mapping."""
    def add(factory: ConverterFactory) -> ConverterFactory:
        CONVERTERS.add(name, Registration(factory, checkpoint_label, fix or Registration.fix), origin=factory,
                       options=options)
        return factory
    return add


def registered_converters() -> list[str]:
    return CONVERTERS.names()


@dataclass(frozen=True)
class ModelConverters:
    """The configured converters, applied in the order the config names them, and what the rest
    of megarl asks of them once applied."""
    steps: tuple[tuple[str, Converter], ...] = ()
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def convert(self, chunks: list[nn.Module]) -> None:
        for _, step in self.steps:
            step(chunks)

    def _hooks(self) -> list[ConverterHooks]:
        return [step for _, step in self.steps if isinstance(step, ConverterHooks)]

    def added(self, name: str) -> bool:
        return any(h.added(name) for h in self._hooks())

    def exported(self, chunk: nn.Module) -> Exports:
        out: Exports = {}
        for h in self._hooks():
            out.update(h.exported(chunk))
        return out

    def export_value(self, chunks: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        """param -> what an HF export holds for it (a hook's value, else the parameter, detached)."""
        computed = {}
        for chunk in chunks:
            for name, fn in self.exported(chunk).items():
                computed[id(chunk.get_parameter(name))] = fn
        return lambda p: computed[id(p)]() if id(p) in computed else p.detach()

    @contextlib.contextmanager
    def original(self, chunks: list[nn.Module]):
        """The model before every converter, for the duration (a LoRA actor's reference policy)."""
        with contextlib.ExitStack() as stack:
            for h in reversed(self._hooks()):
                stack.enter_context(h.original(chunks))
            yield


class ExportedParams(dict):
    """name -> tensor, where the entries a converter exports differently are computed when read (so
    every weight sync sends, e.g., LoRA's merged weights as they are then, and no computed copy
    outlives its read)."""

    def __init__(self, base: dict[str, torch.Tensor], computed: Exports):
        super().__init__(base)
        self.computed = computed

    def __getitem__(self, name: str) -> torch.Tensor:
        fn = self.computed.get(name)
        return fn() if fn is not None else super().__getitem__(name)


def as_options(config: Sequence[str] | Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """model.converters (a list of names, or name -> options) as name -> options."""
    if isinstance(config, Mapping):
        return {n: dict(opts or {}) for n, opts in config.items()}
    return {name: {} for name in config or ()}


def build_model_converters(config: Sequence[str] | Mapping[str, Mapping[str, Any]] | None) -> ModelConverters:
    """Converters from their names (or name -> options); an unknown name is refused in one line."""
    named = as_options(config)
    unknown = [n for n in named if n not in CONVERTERS]
    if unknown:
        raise ValueError(f"model.converters: unknown converter(s) {', '.join(unknown)}; registered: "
                         f"{', '.join(registered_converters()) or 'none'} (register one with "
                         "megarl.models.converters.register_converter, imported by model.external_lib)")
    steps = []
    for n, opts in named.items():
        factory = CONVERTERS.get(n).factory
        typed = CONVERTERS.build_options(n, opts, f"model.converters.{n}") if CONVERTERS.options_of(n) else opts
        steps.append((n, factory(typed)))
    return ModelConverters(tuple(steps), named)


def checkpoint_mismatch(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """Why a checkpoint saved with converters `saved` (name -> options) cannot load into a role
    with `mine`, or None: only converters registered with a checkpoint label shape a checkpoint."""
    for name in sorted(set(saved) | set(mine)):
        reg = CONVERTERS.get(name) if name in CONVERTERS else None
        if reg is not None and reg.label is not None and saved.get(name) != mine.get(name):
            return f"saved with {reg.label} {saved.get(name)}, this role has {mine.get(name)}; {reg.fix}"
    return None
