"""The weight-sync transports by name (`actor_rollout_ref.rollout.checkpoint_engine.backend`):
what each one serves, declared once, next to nothing heavy.

    register(Transport(name="mine", placements=("colocated",), delta=False, build="pkg.mod:build_mine"))
    transport("disk")              # its entry: placements, delta support, config checks, build
    transport_names()              # every backend a config may name

Every module of this package declares one transport, its file name the transport's name, and
registers its entry when imported; a transport defined elsewhere (a user's package, a test) calls
`register` itself, in a module imported before the config is loaded or named by model.external_lib.
A transport's own options are a Section class it registers; the config gives them as
`checkpoint_engine.engine_kwargs.<name>.<key>` (verl's place for a checkpoint engine's arguments).
Nothing here imports torch or the sync's code: the config (megarl/rollout/config.py) reads the
names from the module files, and a transport's build, named by its "module:function" path, is
imported by megarl/checkpoint_engine when a rank builds it (the build side of an entry:
megarl/checkpoint_engine/transport.py).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.plugins import import_external_libs
from megarl.config.registry import Registry, package_modules

KEY = "actor_rollout_ref.rollout.checkpoint_engine"
PLACEMENTS = ("colocated", "disaggregated")       # rollout.placement's values
ALIASES = ("auto", "delta_sharded", "naive")      # read by CheckpointEngineConfig, never registered
_PACKAGE = __name__


@dataclass(frozen=True)
class TransportRules:
    """What the config checks read about a transport."""
    name: str
    placements: tuple[str, ...]            # the rollout.placement values it serves
    delta: bool                            # whether checkpoint_engine.delta=on can send deltas over it
    # backend=auto picks it for these placements (at most one transport per placement)
    auto_for: tuple[str, ...] = ()
    # rules on the experiment config when this transport is chosen, each raising ConfigError
    checks: tuple[Callable[[Any], None], ...] = ()
    # the Section dataclass of its own keys, given as checkpoint_engine.engine_kwargs.<name>.<key>
    # (verl's place for a checkpoint engine's arguments); None: it reads none
    options: type | None = None

    def __post_init__(self):
        unknown = set(self.placements) - set(PLACEMENTS)
        if unknown or not self.placements:
            raise ValueError(f"transport {self.name!r}: placements must be some of {PLACEMENTS}, got {self.placements}")
        if not set(self.auto_for) <= set(self.placements):
            raise ValueError(f"transport {self.name!r}: auto_for {self.auto_for} names a placement it does not serve")



@dataclass(frozen=True)
class Transport(TransportRules):
    """A registered transport: the rules the config reads, and how one rank builds its side.
    `build` takes a megarl.checkpoint_engine.transport.BuildParts and returns that rank's WeightSync
    (typed loosely here: this package sits below the sync's code). It is a function or its
    "module:function" path; the built-in transports give the path, so the registration (read when
    the config is loaded) imports no torch."""
    build: Callable[[Any], Any] | str = field(kw_only=True)

    def builder(self) -> Callable[[Any], Any]:
        if callable(self.build):
            return self.build
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)

# megarl's transports: one module each in this package, found by file name
TRANSPORTS = Registry("transport", f"{KEY}.backend", package_modules(_PACKAGE))


def register(entry: TransportRules, module: str | None = None) -> TransportRules:
    """Make `entry.name` a backend the config accepts and build_checkpoint_engine builds. megarl's
    own transport modules pass their `__name__` (a built-in name is theirs alone)."""
    if entry.name in ALIASES:
        raise ValueError(f"{entry.name!r} is a backend alias of the config; pick another transport name")
    for placement in entry.auto_for:
        loaded = [(n, TRANSPORTS.loaded(n)) for n in TRANSPORTS.names() if n != entry.name]
        taken = [n for n, other in loaded if other is not None and placement in other.auto_for]
        if taken:
            raise ValueError(f"transport {entry.name!r}: backend=auto already picks {taken[0]!r} for "
                             f"placement={placement}")
    TRANSPORTS.add(entry.name, entry, origin=module or f"{entry.name} (a transport of your own)",
                   options=entry.options)
    return entry


def transport_options(name: str, given: dict[str, Any] | None) -> Any:
    """Transport `name`'s options from engine_kwargs.<name> (typed and checked by its options class;
    None when it reads none). A key it does not read is one line naming the transport and its keys."""
    if name not in TRANSPORTS:
        raise ConfigError(unknown_backend(name), f"{KEY}.engine_kwargs.{name}")
    transport(name)                        # a built-in's module registers its options class
    return TRANSPORTS.build_options(name, given, f"{KEY}.engine_kwargs.{name}")


def check_transport(cfg) -> None:
    """The backend and each engine_kwargs.<name> name a registered transport (a user's once its module
    ran: before the config loads, or as model.external_lib, imported here for that), and each
    engine_kwargs.<name> is typed by that transport's options class."""
    ce = cfg.rollout.checkpoint_engine
    names = [n for n in (ce.backend, *ce.engine_kwargs) if n not in ALIASES]
    if not all(n in TRANSPORTS for n in names):
        import_external_libs(cfg)
    if ce.backend not in ALIASES and ce.backend not in TRANSPORTS:
        raise ConfigError(unknown_backend(ce.backend), f"{KEY}.backend")
    ce.engine_kwargs = {name: transport_options(name, given) for name, given in ce.engine_kwargs.items()}


def unread_options(entry: TransportRules, engine_kwargs: dict[str, Any]) -> str | None:
    """Why engine_kwargs names a transport other than the chosen one (its keys would go unread), or None."""
    others = sorted(set(engine_kwargs) - {entry.name})
    if not others:
        return None
    return (f"engine_kwargs.{others[0]} is read by the {others[0]} transport, and weights move over "
            f"{entry.name}; remove it or set backend={others[0]}")


def unregister(name: str) -> None:
    TRANSPORTS.unregister(name)


def transport_names() -> list[str]:
    """Every registered backend, sorted (torch-free: built-in modules are not imported)."""
    return TRANSPORTS.names()


def unknown_backend(backend: str) -> str:
    """The one-line message for a backend no transport registered."""
    return (f"unknown transport {backend!r}; registered: {', '.join(transport_names())} "
            "(or auto: from rollout.placement)")


def transport(name: str) -> TransportRules:
    """The entry of transport `name`, importing its built-in module on first use (each transport's
    module imports torch, the config must not)."""
    if name not in TRANSPORTS:
        raise ConfigError(unknown_backend(name), f"{KEY}.backend")
    return TRANSPORTS.get(name)


def chosen(backend: str, placement: str) -> TransportRules:
    """The transport `backend` names under `placement` (backend=auto: the one marked for it)."""
    if backend != "auto":
        return transport(backend)
    for name in transport_names():
        entry = transport(name)
        if placement in entry.auto_for:
            return entry
    raise ConfigError(f"no registered transport is the default for placement={placement}; name one "
                      f"({', '.join(transport_names())})", f"{KEY}.backend")


def serving(placement: str) -> list[str]:
    """The registered transports that serve `placement`."""
    return [n for n in transport_names() if placement in transport(n).placements]


def placement_problem(entry: TransportRules, placement: str) -> str | None:
    """Why `entry` cannot serve `placement` (one line naming the fix), or None."""
    if placement in entry.placements:
        return None
    default = [n for n in serving(placement) if placement in transport(n).auto_for]
    over = f"; with placement={placement} weights move over the {default[0]} transport" if default else ""
    return (f"is {entry.name}, which serves placement={' or '.join(entry.placements)} only{over}: set backend="
            f"{' or '.join(['auto', *serving(placement)])}, or rollout.placement={entry.placements[0]}")


def delta_problem(entry: TransportRules, placement: str) -> str | None:
    """Why delta=on cannot run over `entry` (one line naming the fix), or None."""
    if entry.delta:
        return None
    able = [n for n in transport_names() if transport(n).delta]
    here = [n for n in able if placement in transport(n).placements]
    elsewhere = [n for n in able if n not in here]
    if not able:
        return "=on needs a transport that sends deltas and none is registered; set delta=off or auto"
    return (f"=on needs a transport that sends deltas, the {' or '.join(elsewhere + here)} transport ({entry.name} "
            "sends whole tensors); set delta=off or auto" + (f", or backend={' or '.join(here)}" if here else ""))
