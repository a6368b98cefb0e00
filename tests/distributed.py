"""Run a function on N real gloo processes from a test and collect what each rank returns.

    results = run_ranks(world_size=4, fn=check_layout, args=(tp, pp))   # fn(rank, world, *args)

Each spawn costs seconds (process start), so tests group many checks into one function and one
spawn. `fn` must be importable (module level).

The ranks are forked by one server process per test session that imported torch, megatron-core
and transformers once (multiprocessing's forkserver, with those preloaded): a rank starts in
~0.5 s instead of re-importing them (~8 s of CPU each, ~75 ranks in the suite). The server holds
no test's state: each rank still unpickles `fn` and imports its module itself, and takes the
caller's current environment variables, working directory and sys.path, as a spawned one would.
On a machine with CUDA (tests/gpu) the ranks are spawned instead (START_METHOD, below).
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import socket
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

# Imported once, in the server; everything else (megarl included) each rank imports itself.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
# Where CUDA is visible, a process forked from a server that imported megatron-core cannot start CUDA
# (on an H100, torch.cuda._is_in_bad_fork() is True in such a child; False when the server imported
# torch, torch.distributed or transformers alone): there each rank is spawned, and imports it all.
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"


def _stop_server() -> None:
    """End the server and reap it, so its ranks' CPU time is counted as this process's children's."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


atexit.register(_stop_server)


# Results are any Python object a check returns (sets, tuple keys, ...), so they travel as pickles,
# written by this test's own child processes into a private temporary directory (mode 0700) and
# read back by the parent only. megarl itself unpickles no file (docs/security.md).
def _write(path: str, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _read(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, outdir: str, payload: bytes, env: dict, caller: dict) -> None:
    os.environ.clear()                  # the caller's environment now, not the server's at its start
    os.environ.update(caller["environ"])
    os.chdir(caller["cwd"])
    sys.path[:] = caller["path"]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), **env})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        fn, args = pickle.loads(payload)
        result = fn(rank, world, *args)
        _write(path, {"ok": True, "result": result})
    except BaseException:  # report to the parent instead of dying silently
        _write(path, {"ok": False, "error": traceback.format_exc()})
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(world_size: int, fn, args: tuple = (), env: dict | None = None, timeout: float = 600) -> list:
    """Spawn `world_size` processes running fn(rank, world_size, *args); return their results."""
    with tempfile.TemporaryDirectory() as outdir:
        caller = {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
        # By value (tensors included): torch's multiprocessing pickler would send each tensor as a
        # shared-memory descriptor, and a forkserver passes at most ~250 of them per process.
        payload = pickle.dumps((fn, args))
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), outdir, payload, env or {}, caller),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
        errors = []
        try:
            while not ctx.join(timeout=timeout):
                pass
        except Exception as err:  # a rank failed: collect every rank's traceback for the message
            errors.append(str(err))
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} left no result")
                continue
            got = _read(path)
            if not got["ok"]:
                errors.append(f"rank {rank}:\n{got['error']}")
            results.append(got.get("result"))
        if errors:
            raise AssertionError("\n".join(errors))
        return results
