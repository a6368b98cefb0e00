"""The one shape of a name registry: what a config names (an advantage estimator, a policy loss, a
KL estimator, a model converter) -> the code that implements it.

megarl's own entries are declared as "module:attribute" paths, so the config knows every built-in
name without importing torch; a path's module is imported when its entry is first asked for, and
that module must register the entry under the declared name from the declared attribute (a renamed
function fails at import, not at the first step). A user's entries register themselves when their
module runs, imported before the config loads or named by `model.external_lib`.

    ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator", {"grpo": "m.adv:grpo"})

    @ADV_ESTIMATORS.register("my_grpo")          # a function is its own entry
    def my_grpo(...): ...

    CONVERTERS.add("lora", Registration(lora, ...), origin=lora)   # an entry that wraps a function
    TRANSPORTS.add("disk", Transport(...), origin=__name__)        # an entry its module makes

A kind whose built-ins are one module each (the weight-sync transports) declares them with
`package_modules`, so a new built-in is a new file and nothing else.

An entry may carry its own options: a dataclass (a megarl.config.typed.Section) of the keys it
reads, given at registration (`register("mine", options=MyOptions)`) or, for a built-in whose code
loads torch, declared beside its path as "module:Class" of a torch-free module. `build_options`
types and checks the keys a config gives an entry against that class, so `--check` catches a
misspelled option without importing the entry's code.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.typed import Section, build, closest, key_like, not_a_key


def origin_of(obj: Any) -> str:
    """"module:qualname" of a function or class (what a built-in declaration names); a string is a
    module's name already (an entry made at a module's top level, declared by the module alone)."""
    return obj if isinstance(obj, str) else f"{obj.__module__}:{obj.__qualname__}"


def package_modules(package: str) -> dict[str, str]:
    """name -> module for every public module of `package`, read from its file names (nothing imported):
    the built-ins of a kind whose entries are one module each."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package} is not a package")
    return {m.name: f"{package}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)
            if not m.name.startswith("_")}


class Registry:
    def __init__(self, kind: str, key: str, builtins: dict[str, str] | None = None,
                 options: dict[str, str] | None = None):
        self.kind, self.key = kind, key       # "advantage estimator", "algorithm.adv_estimator"
        self._entries: dict[str, Any] = {}
        # name -> "module:attribute" (or "module" for an entry made at its top level), loaded lazily
        self._paths: dict[str, str] = dict(builtins or {})
        # name -> its options class, or the "module:Class" of a built-in's (a torch-free module)
        self._options: dict[str, type | str] = dict(options or {})

    def add(self, name: str, entry: Any, origin: Any, options: type | None = None) -> None:
        """Register `entry` under `name`; `origin` is the function or class it comes from, or the name
        of the module that makes it (checked against a built-in declaration of the same name);
        `options` is the Section dataclass of the keys the entry reads, if it reads any."""
        path, made_by = self._paths.get(name), origin_of(origin)
        if path is not None and made_by not in (path, path.partition(":")[0]):
            raise ValueError(f"{self.kind} {name!r} is megarl's built-in {path}; register yours under another name")
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered to {self._describe(self._entries[name])}")
        if options is not None:
            if not (isinstance(options, type) and dataclasses.is_dataclass(options) and issubclass(options, Section)):
                raise ValueError(f"{self.kind} {name!r}: options must be a @dataclass deriving from "
                                 f"megarl.config.typed.Section, got {options!r}")
            self._options[name] = options
        self._entries[name] = entry

    def register(self, *names: str, options: type | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: the function itself is the entry under each of `names` (reading `options`)."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            for name in names:
                self.add(name, fn, fn, options)
            return fn
        return deco

    def options_of(self, name: str) -> type | None:
        """The options class of entry `name` (None: it reads no keys of its own). A built-in's comes
        from its declared torch-free module; a registered entry's from its registration."""
        declared = self._options.get(name)
        if isinstance(declared, str):
            module, _, attr = declared.partition(":")
            declared = self._options[name] = getattr(importlib.import_module(module), attr)
        return declared

    def build_options(self, name: str, raw: dict[str, Any] | None, prefix: str,
                      tolerated: Callable[[str, Any], bool] | None = None, beside: Iterable[str] = ()) -> Any:
        """The options of entry `name` built from the keys `raw` gives it (under config key `prefix`),
        typed and checked by its class; None when it reads none. A key it does not read is one line
        naming the entry and its keys, unless `tolerated(key, value)` (a section's shared keys);
        `beside` are the section's own keys, offered too when a key is misspelled."""
        cls = self.options_of(name)
        known = sorted(f.name for f in dataclasses.fields(cls) if f.init) if cls else []
        mine = {}
        for key, value in (raw or {}).items():
            if key in known:
                mine[key] = value
            elif not key_like(key):
                raise not_a_key(key, prefix)
            elif tolerated is None or not tolerated(key, value):
                hint = closest(str(key), [*known, *beside])
                fix = f"did you mean {hint!r}? " if hint else ""
                reads = f"reads {', '.join(known)}" if known else "reads no keys of its own"
                raise ConfigError(f"unknown key; {fix}{self.kind} {name!r} {reads}", f"{prefix}.{key}")
        return build(cls, mine, prefix) if cls else None

    def check(self, name: str, key: str | None = None) -> None:
        """One line naming the known names unless `name` is one (imports nothing)."""
        if name not in self:
            names = self.names()
            hint = closest(name, names)
            fix = f"did you mean {hint!r}? " if hint else ""
            raise ConfigError(f"unknown {self.kind} {name!r}; {fix}choose one of {', '.join(names) or 'none'}",
                              key or self.key)

    def check_all(self, names: Iterable[str], key: str | None = None) -> None:
        for name in names:
            self.check(name, key)

    def get(self, name: str) -> Any:
        self.check(name)
        if name not in self._entries:
            module, _, attr = self._paths[name].partition(":")
            loaded = importlib.import_module(module)     # its registration runs here
            if name not in self._entries and attr and not callable(getattr(loaded, attr, None)):
                # a declaration the module holds as data (an engine's EngineInfo) is the entry itself
                self._entries[name] = getattr(loaded, attr)
            if name not in self._entries:
                raise RuntimeError(f"{module} is declared to register {self.kind} {name!r} and did not")
        return self._entries[name]

    def loaded(self, name: str) -> Any | None:
        """The entry if registered already, without importing anything."""
        return self._entries.get(name)

    def load_builtins(self) -> None:
        for name in self._paths:
            self.get(name)

    def unregister(self, name: str) -> None:
        """Remove a user's entry (megarl's built-ins stay)."""
        if name in self._paths:
            raise ValueError(f"{self.kind} {name!r} is megarl's built-in; it cannot be unregistered")
        self._entries.pop(name, None)
        self._options.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._paths))

    def builtin(self, name: str) -> str | None:
        """The "module:attribute" path of a megarl built-in, None for another name."""
        return self._paths.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._paths

    @staticmethod
    def _describe(entry: Any) -> str:
        return getattr(entry, "__qualname__", None) or type(entry).__qualname__
