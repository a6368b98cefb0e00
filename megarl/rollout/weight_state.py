"""Bookkeeping of an in-place weight sync, shared by the engines that load in place (native, hf).

Buckets are copied straight into the live parameters (no second copy of the model). The price:
between the first bucket and a successful `finalize` the parameters are a mix of old and new,
so generation is refused in every state but "ready":

    empty      built without weights (load_format=dummy): waits for the first sync
    updating   buckets arriving; finalize() not called yet
    incomplete finalize() found missing tensors, or a started sync was aborted
    released   sleep(level=2) dropped the weights; the next full sync brings them back
    ready      the last sync delivered every expected tensor
"""
from __future__ import annotations

from collections.abc import Iterable


class WeightState:
    def __init__(self, expected: Iterable[str], ready: bool):
        self.expected = list(expected)
        self._expected_set = set(self.expected)
        self.state = "ready" if ready else "empty"
        self._before = self.state
        self._got: set[str] = set()
        self.syncs = 0

    def begin_bucket(self) -> None:
        if self.state != "updating":
            self._before, self.state, self._got = self.state, "updating", set()

    def begin_delta(self) -> None:
        """A delta sync: it writes some elements in place, every tensor counts as received."""
        if self.state != "ready":
            raise RuntimeError(f"a delta weight sync needs the weights of the last sync, but the engine's are "
                               f"{self.state}; the next sync sends every weight")
        self._before, self.state, self._got = "ready", "updating", set(self.expected)

    def undo_delta(self) -> None:
        """The sync undid an aborted delta's writes: the weights are the last complete ones again."""
        if self.state == "incomplete" and self._before == "ready":
            self.state = "ready"

    def received(self, name: str) -> None:
        if name in self._expected_set:
            self._got.add(name)

    def finalize(self) -> None:
        if self.state != "updating":
            raise RuntimeError("finalize_weights() called without any update_weights() bucket before it")
        missing = [n for n in self.expected if n not in self._got]
        if missing:
            self.state = "incomplete"
            raise ValueError(f"weight update incomplete: {len(missing)} of {len(self.expected)} tensors never "
                             f"arrived (first: {', '.join(missing[:3])}); the engine refuses to generate until "
                             "a full sync (every tensor, then finalize_weights) succeeds")
        self.state, self._got = "ready", set()
        self.syncs += 1

    def abort(self) -> None:
        if self.state == "updating":
            # Nothing written yet: the old weights are intact. Otherwise they are a mix.
            self.state = self._before if not self._got else "incomplete"
            self._got = set()

    def mixed(self) -> None:
        """A bucket failed part-way through loading: the weights are a mix, whatever was received."""
        self.state, self._got = "incomplete", set()

    def release(self) -> None:
        if self.state != "updating":
            self.state = "released"

    def check_ready(self) -> None:
        why = {
            "empty": "has no weights yet (built with load_format=dummy): sync weights first "
                     "(update_weights for every tensor, then finalize_weights)",
            "updating": "is in the middle of a weight update: call finalize_weights() first",
            "incomplete": "did not receive a complete weight update: run a full sync "
                          "(update_weights for every tensor, then finalize_weights) before generating",
            "released": "released its weights in sleep(level=2): sync weights before generating",
        }.get(self.state)
        if why:
            raise RuntimeError(f"rollout engine {why}")
