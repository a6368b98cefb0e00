"""Peak memory a weight sync adds on this rank, measured, not estimated.

    with PeakMemory(device) as mem:
        ...                                   # the sync
    mem.extra_mb                              # peak above the start, MiB (-1 where it cannot be measured)

CUDA: the caching allocator's peak (torch.cuda.max_memory_allocated) above the allocation at
the start. CPU: the process's resident-set high-water mark (VmHWM) above the resident set at the
start, with the mark reset through /proc/self/clear_refs first, so it counts everything the sync
touches, gloo's own buffers included.
"""
from __future__ import annotations

import math

import torch

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_high_water_mark() -> bool:
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")                   # 5: reset the peak resident set size to the current one
        return True
    except OSError:
        return False


class PeakMemory:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.extra_bytes = math.nan
        self._start: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif _reset_high_water_mark():
            rss = _status_kb("VmRSS")
            self._start = None if rss is None else rss * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            hwm = _status_kb("VmHWM")
            if hwm is None:
                return
            peak = hwm * 1024
        self.extra_bytes = float(max(0, peak - self._start))

    @property
    def extra_mb(self) -> float:
        return self.extra_bytes / 2**20 if self.extra_bytes == self.extra_bytes else -1.0
