"""Room for a gloo process group under an address-space limit (`ulimit -v`, RLIMIT_AS).

    check_room_for_group()             # before torch.distributed starts a group: MemoryError if it cannot fit
    with checked_groups(): ...         # every dist.new_group inside is checked first (megatron's too)

Each gloo process group starts three threads (measured on torch 2.13: two run loops and a TCP
loop), whose stacks reserve RLIMIT_STACK each (8 MiB by default) and whose allocations may open a
new malloc arena (64 MiB of address space): megatron's ~25 groups take about 1 GiB of a rank's
address space on 2 ranks. When a thread cannot be mapped, ProcessGroupGloo's constructor fails
half-way and its clean-up waits forever on a condition variable its started threads still use,
so the rank hangs instead of failing. Refusing first turns that hang into megarl's one-line
out-of-memory report (exit code 5). Without a limit nothing is checked.
"""
from __future__ import annotations

import contextlib
import resource

import torch.distributed as dist

THREADS_PER_GROUP = 3
ARENA = 64 << 20                 # glibc's malloc arena reservation on 64-bit (HEAP_MAX_SIZE)
# RLIMIT_STACK unlimited: glibc then uses its architecture's default (2 MiB on x86-64); 8 MiB over-counts safely
DEFAULT_STACK = 8 << 20


def address_space_left() -> int | None:
    """Bytes this process may still map under RLIMIT_AS, or None without a limit."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    return soft - size


def group_need() -> int:
    """Address space one gloo group may take: its threads' stacks and one allocator arena."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = DEFAULT_STACK if stack == resource.RLIM_INFINITY else stack
    return THREADS_PER_GROUP * stack + ARENA


def check_room_for_group() -> None:
    left = address_space_left()
    if left is not None and left < group_need():
        raise MemoryError(f"cannot start a process group: {max(left, 0) / 2**20:.0f} MiB of address space left, "
                          f"a gloo group needs up to {group_need() / 2**20:.0f} MiB (thread stacks and an "
                          "allocator arena)")


@contextlib.contextmanager
def checked_groups():
    """dist.new_group checks for room first while inside (megatron creates its groups through it)."""
    original = dist.new_group

    def new_group(*args, **kwargs):
        check_room_for_group()
        return original(*args, **kwargs)
    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original
