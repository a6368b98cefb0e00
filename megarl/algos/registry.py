"""Name -> function registries for the algorithm choices a config makes.

`algorithm.adv_estimator`, `actor.policy_loss.loss_mode` and the KL types are looked up here, so
the training loop never branches on them. Users can add their own with the decorators.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.typed import closest


class Registry:
    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key       # "advantage estimator", "algorithm.adv_estimator"
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, *names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            for name in names:
                if name in self._fns and self._fns[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered to {self._fns[name].__qualname__}")
                self._fns[name] = fn
            return fn
        return deco

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._fns:
            hint = closest(name, sorted(self._fns))
            fix = f"did you mean {hint!r}? " if hint else ""
            raise ConfigError(f"unknown {self.kind} {name!r}; {fix}choose one of {', '.join(sorted(self._fns))}",
                              self.key)
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns
