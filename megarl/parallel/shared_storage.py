"""The run directory must be one directory for every node: checked once the process group is up.

Rank 0 writes the checkpoints' pointer, the metrics and the lock there, and every rank writes its
checkpoint shards there and resumes from what rank 0 names; on node-local storage (a /tmp or a
/scratch that each node has its own of) a multi-node run would save shards no one can resume and
fail far from the cause. Rank 0 writes a file with a fresh token, every rank reads it back, and the
ranks that do not see it are named, with their hosts, in one line on every rank.
"""
from __future__ import annotations

import os
import secrets
import socket

import torch
import torch.distributed as dist

from megarl.config import ConfigError

_TOKEN_BYTES = 16


def check_shared_dir(path: str, key: str = "trainer.default_local_dir") -> None:
    """Collective over the default group; a no-op when every rank is on this node."""
    world = dist.get_world_size()
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return
    rank = dist.get_rank()
    # The token travels as a byte tensor: nothing read from the network is unpickled.
    token = torch.zeros(_TOKEN_BYTES, dtype=torch.uint8)
    probe = None
    if rank == 0:
        token = torch.tensor(list(secrets.token_bytes(_TOKEN_BYTES)), dtype=torch.uint8)
    dist.broadcast(token, 0)
    probe = os.path.join(path, f".megarl-shared-{bytes(token.tolist()).hex()}")
    if rank == 0:
        with open(probe, "wb") as f:
            f.write(bytes(token.tolist()))
    dist.barrier()
    try:
        with open(probe, "rb") as f:
            seen = f.read() == bytes(token.tolist())
    except OSError:
        seen = False
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(seen)], dtype=torch.int32))
    dist.barrier()
    if rank == 0:
        os.remove(probe)
    blind = [r for r, f in enumerate(flags) if not f.item()]
    if blind:
        here = f" (this rank, on {socket.gethostname()}, is one)" if rank in blind else ""
        raise ConfigError(f"{os.path.abspath(path)} is not shared between nodes: rank(s) "
                          f"{', '.join(map(str, blind))} do not see the file rank 0 wrote there{here}; put it on "
                          "storage every node mounts at the same path", key)
