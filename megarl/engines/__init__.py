"""What each rollout engine can do, declared once, next to nothing heavy.

    from megarl.engines import lookup, known
    info = lookup("native")          # EngineInfo, or None for a name nobody declared
    info.records_routes, info.devices, info.logprobs_exact_at("float32")

Every module of this package declares one engine as `ENGINE = EngineInfo(...)`, its file name the
engine's name (the shared registry shape, megarl/config/registry.py); adding an engine is adding such
a file (its `build` names the function that constructs it, loaded only when a rank builds it). The
registry, preflight, the bypass decision, routing replay and the config checks read these declarations
and never compare engine names. This package imports no torch and no engine module: the launcher
reads it before torch loads (tests/test_repo.py).

A user's class (rollout.name=custom) declares the same abilities as class attributes
(`records_routes = True`, ...); `EngineInfo.declared_by(cls)` reads them, a missing one keeping the
conservative default below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megarl.config.errors import ConfigError
from megarl.config.registry import Registry, package_modules
from megarl.config.typed import closest

# The abilities a user's class may declare as class attributes.
CLASS_ABILITIES = ("devices", "records_routes", "exact_logprob_dtypes", "captures_cuda_graphs", "takes_hf_overrides")


@dataclass(frozen=True)
class EngineInfo:
    name: str                                      # rollout.name
    summary: str                                   # a few words shown where engines are suggested
    title: str = ""                                # what messages call it ("built-in engine"); "" = name
    build: str = ""                                # "module:function" building it on a rank
    refused: str = ""                              # not integrated: why, in one line (nothing builds it)
    requires: str | None = None                    # a module that must import for it to build
    default: bool = False                          # rollout.name's default, named in fixes ("use ...")
    suggested: bool = False                        # listed where a refused engine's alternatives are
    user_class: bool = False                       # abilities come from the user's class (declared_by)
    devices: tuple[str, ...] = ("cpu", "cuda")     # torch device types it generates on
    records_routes: bool = False                   # returns each token's MoE experts (R3 routing replay)
    why_no_routes: str = "it does not record the routed experts"
    # Dtypes at which its log-probs equal the trainer's (same dtype on both sides) to fp32 rounding:
    # only then may the old-log-prob pass be skipped without a tolerance (trainer/loop/bypass.py).
    exact_logprob_dtypes: tuple[str, ...] = ()
    captures_cuda_graphs: bool = False             # rollout.enforce_eager=false means something to it
    # Builds its model from config.json with model.override_config applied, as the trainer does; an
    # engine that reads config.json as it is on disk would compute another model (other log-probs).
    takes_hf_overrides: bool = False
    # Runs a Ray of its own inside the rank's process and shuts it down with itself: megarl's Ray
    # pools (async reward scoring, Ray tool calls) cannot share that process. With a variable
    # named in process_ray_switch, only where the environment sets it to "1".
    owns_process_ray: bool = False
    process_ray_switch: str = ""
    graphs_hint: str = "leave enforce_eager unset"  # where its own graph setting lives instead
    sleeps: bool = True                            # free_cache_engine / enable_sleep_mode mean something to it
    min_head_dim: int = 0                          # smallest attention head size its kernels take (0: any)
    max_tp: int = 0                                # largest rollout tensor_model_parallel_size it runs (0: any)
    # Rollout TP > 1 only with placement=colocated: its TP groups are formed over every rank of the
    # job (vLLM's external_launcher), which a disaggregated run's trainer ranks never join.
    tp_colocated_only: bool = False
    # A weight update may land inside its pausable call, the K/V so far kept, and a new batch may
    # join that call (async_training.kv_after_update=keep; each token's version from the loads
    # before it, Completion.weight_epochs). Declared by built-in engines only: a user's class
    # cannot claim it.
    updates_inside_call: bool = False

    @property
    def called(self) -> str:
        return self.title or f"{self.name} engine"

    def logprobs_exact_at(self, dtype: str) -> bool:
        return dtype in self.exact_logprob_dtypes

    def declared_by(self, cls: type) -> EngineInfo:
        """This info with the abilities `cls` declares as class attributes."""
        declared = {k: getattr(cls, k) for k in CLASS_ABILITIES if hasattr(cls, k)}
        declared = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in declared.items()}
        if not declared.get("records_routes"):
            declared["why_no_routes"] = f"{cls.__name__} does not declare records_routes = True"
        return dataclasses.replace(self, **declared)

    def overrides_refusal(self, keys: list[str]) -> str:
        """One line refusing HF config overrides for an engine that cannot take them, or ""."""
        if self.takes_hf_overrides or not keys:
            return ""
        fix = ("declare takes_hf_overrides = True on the class (it is then built with hf_overrides=<dict>)"
               if self.user_class else "write them into the checkpoint's config.json")
        return (f"sets {', '.join(keys)}, but the {self.called} builds its model from config.json as it is on disk, "
                f"so its log-probs would come from another model than the trainer's; {fix}, or use an engine "
                f"that takes them (rollout.name={default_name()})")


# megarl's engines: one module each in this package, holding its declaration as ENGINE
ENGINES = Registry("rollout engine", "actor_rollout_ref.rollout.name",
                   {name: f"{module}:ENGINE" for name, module in package_modules(__name__).items()})


def register(info: EngineInfo) -> EngineInfo:
    """Declare an engine from outside this package (a plugin, a test); a name is declared once
    (declaring the same thing again is harmless; a built-in's name is its module's alone)."""
    existing = lookup(info.name)
    if existing == info:
        return info
    if existing is not None and info.name not in _BUILT_IN:
        raise ValueError(f"rollout engine {info.name!r} is already declared differently")
    ENGINES.add(info.name, info, origin=f"{info.name} (an engine of your own)")
    return info


_BUILT_IN = frozenset(ENGINES.names())


def unregister(name: str) -> None:
    if name not in _BUILT_IN:
        ENGINES.unregister(name)


def lookup(name: str) -> EngineInfo | None:
    return ENGINES.get(name) if name in ENGINES else None


def config_info(name: str) -> EngineInfo | None:
    """What the config checks may assume of `name` before any engine code loads: its declaration,
    the conservative defaults for a name nobody declared (refused later, where engines are built),
    or None for a user's class, whose declarations are read where the class loads."""
    info = lookup(name) or EngineInfo(name=name, summary="")
    return None if info.user_class else info


def known() -> list[EngineInfo]:
    """Every declared engine, the default first."""
    return sorted((ENGINES.get(n) for n in ENGINES.names()), key=lambda i: (not i.default, i.name))


def integrated() -> list[EngineInfo]:
    return [i for i in known() if not i.refused]


def default_name() -> str:
    return next(i.name for i in known() if i.default)


def alternatives() -> str:
    """The engines to suggest instead of one that cannot run here."""
    names = [f"rollout.name={i.name} ({i.summary})" for i in integrated() if i.suggested]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def resolve(name: str) -> EngineInfo:
    """The declaration of an engine that can be built; one-line ConfigError for an undeclared name
    (with the closest declared one) or one declared as not integrated (with its reason)."""
    info, key = lookup(name), "actor_rollout_ref.rollout.name"
    if info is None:
        names = [i.name for i in integrated()]
        hint = closest(name, names)
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(names)}"
                          + (f" (did you mean {hint!r}?)" if hint else ""), key)
    if info.refused:
        raise ConfigError(f"{name} is not integrated in megarl; use {alternatives()} instead; {info.refused}", key)
    return info


def declaring(field: str) -> list[str]:
    """The integrated engines whose declaration sets `field` (an EngineInfo flag), for a refusal
    to name the ones that would do."""
    return [i.name for i in integrated() if getattr(i, field)]
