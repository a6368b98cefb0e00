"""Peak memory per phase of a step, logged like the phase timings.

    meter = PhaseMemory(device)
    with meter.phase("gen"): ...           # phases may nest (the step holds them all)
    meter.metrics()                        # {"memory/gen_peak_gb": ..., ...}, then cleared

CUDA: `memory/<phase>_peak_gb`, the caching allocator's highest allocation during the phase
(torch.cuda.max_memory_allocated, reset at each phase boundary). CPU:
`memory/<phase>_rss_growth_gb`, the process's resident-set high-water mark during the phase above
its resident set at the start (VmHWM, reset through /proc/self/clear_refs). A reset at an inner
phase's boundary would hide the outer phase's earlier peak, so each open phase keeps its own
running maximum, updated at every boundary.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megarl.checkpoint_engine.memory import _reset_high_water_mark, _status_kb

GB = 2**30


class PhaseMemory:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.enabled = self.cuda or _status_kb("VmHWM") is not None
        self._open: list[list] = []          # [name, bytes at start, running peak]
        self._done: dict[str, float] = {}

    def _peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return (_status_kb("VmHWM") or 0) * 1024

    def _now(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return (_status_kb("VmRSS") or 0) * 1024

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_high_water_mark()

    def _boundary(self) -> None:
        """Fold the peak since the last boundary into every open phase, then start a new interval."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        peak = self._peak()
        for entry in self._open:
            entry[2] = max(entry[2], peak)
        self._reset()

    @contextmanager
    def phase(self, name: str | None):
        if not self.enabled or name is None:
            yield
            return
        self._boundary()
        now = self._now()
        self._open.append([name, now, now])
        try:
            yield
        finally:
            self._boundary()
            entry = self._open.pop()
            _, start, peak = entry
            value = peak if self.cuda else max(0, peak - start)
            self._done[name] = max(self._done.get(name, 0.0), value / GB)

    def metrics(self) -> dict[str, float]:
        suffix = "peak_gb" if self.cuda else "rss_growth_gb"
        out = {f"memory/{name}_{suffix}": v for name, v in self._done.items()}
        self._done = {}
        return out
