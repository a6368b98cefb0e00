"""Run a function on N local processes joined in one torch.distributed world (for tools).

    results = run_local(4, fn, args)     # fn(rank, world, *args) -> plain data (megarl.plain_state); one per rank

Under torchrun/srun (RANK already set) the tools call `fn` directly instead. `fn` must be
importable from a module or defined in a script guarded by `if __name__ == "__main__"`.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from megarl.plain_state import load_plain, save_plain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, outdir: str, fn, args) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
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


def run_local(world: int, fn, args: tuple = ()) -> list:
    """fn's result per rank; raises ValueError with the first rank's message when a rank refused
    its input, RuntimeError with tracebacks otherwise."""
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_entry, args=(world, _free_port(), outdir, fn, args), nprocs=world, join=True,
                               start_method="spawn")
        except mp.ProcessExitedException:
            pass  # the failing rank left its message in its file
        files = [os.path.join(outdir, f"rank{r}.pt") for r in range(world)]
        got = [load_plain(f) if os.path.exists(f) else
               {"ok": False, "error": f"rank {r} stopped without a result", "input": False}
               for r, f in enumerate(files)]
    bad = [g for g in got if not g["ok"]]
    if bad:
        if any(g["input"] for g in bad):
            raise ValueError(next(g["error"] for g in bad if g["input"]))
        raise RuntimeError("\n".join(g["error"] for g in bad))
    return [g["result"] for g in got]


def launched() -> bool:
    """True under torchrun / srun with RANK set: the caller is already one of the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
