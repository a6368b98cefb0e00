"""Run a function on N local processes joined in one torch.distributed world (for tools).

    results = run_local(4, fn, args)     # fn(rank, world, *args) -> plain data (storage/plain_state.py), per rank
    results.peak_mb                      # each rank's peak resident set (MiB), sampled from outside

Under torchrun/srun (RANK already set) the tools call `fn` directly instead. `fn` must be
importable from a module or defined in a script guarded by `if __name__ == "__main__"`.

The parent samples every rank's resident set (/proc/<pid>/status, VmRSS and VmHWM) while they
run, so a rank the kernel kills (the OOM killer's SIGKILL leaves no traceback and no result) is
reported as killed, with the peak it had reached, rather than as a rank without a result.
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from megarl.models.megatron_import import import_megatron
from megarl.storage.plain_state import load_plain, save_plain

SAMPLE_S = 0.1     # how often the parent reads the ranks' resident sets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, outdir: str, fn, args) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import_megatron()       # where fn imports megatron as it runs (benchmarks do): without compiling at import
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        save_plain({"ok": True, "result": fn(rank, world, *args)}, path)
    except BaseException as err:
        # A ValueError is an input problem: its one line is the whole message.
        msg = str(err) if isinstance(err, ValueError) else traceback.format_exc()
        save_plain({"ok": False, "error": msg, "input": isinstance(err, ValueError)}, path)
        raise SystemExit(1) from None  # lets the parent stop ranks still waiting on this one
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def resident_mb(pid: int | str = "self", rss_only: bool = False) -> float:
    """The larger of a process's resident set and its high-water mark (MiB); 0 once it is gone.
    Both, because a tool may reset the mark (megarl/checkpoint_engine/memory.py does)."""
    kb = 0
    fields = ("VmRSS:",) if rss_only else ("VmRSS:", "VmHWM:")
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(fields):
                    kb = max(kb, int(line.split()[1]))
    except (OSError, ValueError):
        pass
    return kb / 1024


class RankResults(list):
    """fn's result per rank, with `peak_mb`: each rank's peak resident set, MiB."""
    peak_mb: list[float]


def _ending(exitcode: int | None, peak: float, first: int | None) -> str:
    if exitcode == -signal.SIGTERM and first is not None:
        return f"was stopped (SIGTERM) after rank {first} ended, at a peak of {peak:.0f} MiB resident"
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        why = " (the kernel's OOM killer sends it when memory runs out)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{why} at a peak of {peak:.0f} MiB resident"
    return f"exited with code {exitcode} without a result (peak {peak:.0f} MiB resident)"


def run_local(world: int, fn, args: tuple = ()) -> RankResults:
    """fn's result per rank (with .peak_mb); raises ValueError with the first rank's message when
    a rank refused its input, RuntimeError with tracebacks (or how a rank ended) otherwise."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world, join=False,
                                 start_method="spawn")
        pids = [p.pid for p in ctx.processes]
        peaks = [0.0] * world
        first: int | None = None      # the rank whose ending stopped the others
        while True:
            peaks = [max(peak, resident_mb(pid)) for peak, pid in zip(peaks, pids)]
            try:
                if ctx.join(timeout=SAMPLE_S):
                    break
            except mp.ProcessExitedException as err:
                first = err.error_index
                break       # the failing rank left its message in its file, unless it was killed
        codes = [p.exitcode for p in ctx.processes]
        files = [os.path.join(outdir, f"rank{r}.pt") for r in range(world)]
        got = [load_plain(f) if os.path.exists(f) else
               {"ok": False, "error": f"rank {r} {_ending(codes[r], peaks[r], first)}", "input": False}
               for r, f in enumerate(files)]
    bad = [g for g in got if not g["ok"]]
    if bad:
        if any(g["input"] for g in bad):
            raise ValueError(next(g["error"] for g in bad if g["input"]))
        cause = [got[first]] if first is not None and not got[first]["ok"] else []
        raise RuntimeError("\n".join(g["error"] for g in cause + [g for g in bad if g not in cause]))
    out = RankResults(g["result"] for g in got)
    out.peak_mb = peaks
    return out


def launched() -> bool:
    """True under torchrun / srun with RANK set: the caller is already one of the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
