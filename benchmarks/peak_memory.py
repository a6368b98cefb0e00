"""Peak resident memory of a benchmark's processes, sampled from outside, printed beside its timings.

    with ProcessPeaks() as peaks:             # this process and every process it starts
        ...                                   # the benchmark
    print(peaks.line())                       # "peak resident MiB: main 812, rank 0 1490, rank 1 1502"

A thread reads the resident set of this process and of all its descendants every `every` seconds;
a process is named by the RANK in its environment (torchrun, srun, megarl's launcher), else
"main" for this one and "other" for helpers. The larger of VmRSS and VmHWM counts, since tools
may reset the high-water mark (megarl/checkpoint_engine/memory.py does). Ranks spawned by
megarl.parallel.local_ranks.run_local set RANK after they start; their peaks come back with the
results instead (results.peak_mb).
"""
from __future__ import annotations

import os
import threading

import psutil


def _resident_mb(proc: psutil.Process) -> float:
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            kb = [int(line.split()[1]) for line in f if line.startswith(("VmRSS:", "VmHWM:"))]
        return max(kb, default=0) / 1024
    except (OSError, ValueError):
        return 0.0


def _name(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "main"
    try:
        rank = proc.environ().get("RANK")
    except (psutil.Error, OSError):
        rank = None
    return f"rank {rank}" if rank is not None else "other"


class ProcessPeaks:
    def __init__(self, every: float = 0.2):
        self.every, self.peak_mb = every, {}
        self._stop = threading.Event()
        self._root = psutil.Process(os.getpid())
        self._names: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            name = self._names.get(p.pid) or self._names.setdefault(p.pid, _name(p, self._root.pid))
            self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), _resident_mb(p))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> "ProcessPeaks":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def add(self, ranks_mb: list[float], prefix: str = "rank") -> None:
        """Peaks measured elsewhere (run_local's results.peak_mb)."""
        for r, mb in enumerate(ranks_mb):
            self.peak_mb[f"{prefix} {r}"] = max(self.peak_mb.get(f"{prefix} {r}", 0.0), mb)

    def line(self) -> str:
        order = sorted(self.peak_mb, key=lambda k: (k != "main", k.startswith("other"), k))
        return "peak resident MiB: " + ", ".join(f"{k} {self.peak_mb[k]:.0f}" for k in order)
