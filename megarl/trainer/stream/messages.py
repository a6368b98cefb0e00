"""What crosses between the two sides of a disaggregated run (each side's parts are built in
megarl/job/build.py).

Messages, all on bridges built by setup_ranks (megarl/parallel/bridge.py):
    start      trainer rank 0 -> every rank (world_group): step to start from, data position,
               whether the checkpoint carried the in-flight batch
    update     trainer rank 0 -> the rollout ranks (a key in trainer rank 0's store): "version v is
               ready", so a partial rollout can stop between chunks; then the weight sync itself
               (the distributed transport, megarl/transports/distributed.py:
               bucketed, all-or-nothing; each side builds its half through build_checkpoint_engine)
    hand-off   first rollout rank -> trainer ranks (handoff_group): the next batch, tagged with
               token versions, the data position after its prompts, and validation results
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from megarl.parallel.loopback import listening_store


def send_start(ranks, info: dict | None) -> dict:
    """Trainer rank 0's resume point to every rank of both sides."""
    return ranks.world_group.broadcast_object(info, src=0)


def handoff(ranks, payload: dict | None) -> dict:
    """The first rollout rank's payload to every trainer rank (rollout ranks other than the first
    are not in the group and do not call this)."""
    return ranks.handoff_group.broadcast_object(payload, src=ranks.n_trainers)


class UpdateSignal:
    """Trainer rank 0 tells the rollout ranks that weights `version` are about to be synced.
    It goes through a key-value store of its own (a TCPStore served by trainer rank 0), which the
    rollout side can poll between chunks without blocking; a gloo irecv would not do (its
    completion shows only in wait()). The sync itself is the collective that lines both sides up.
    On one node the store listens on loopback only; across nodes on every interface, at a port
    published through the job's store (docs/security.md lists the ports)."""

    ADDRESS_KEY = "megarl/async/signal_address"

    def __init__(self, ranks, nnodes: int = 1):
        self.store: dist.TCPStore | None = None      # trainer rank 0 and the rollout ranks only
        if ranks.role == "trainer" and ranks.rank == 0:
            host = "127.0.0.1" if nnodes == 1 else "0.0.0.0"
            self.store = listening_store(host)
            reach = "127.0.0.1" if nnodes == 1 else os.environ.get("MASTER_ADDR", socket.getfqdn())
            ranks.store.set(self.ADDRESS_KEY, f"{reach} {self.store.port}")
        elif ranks.role == "rollout":
            host, port = ranks.store.get(self.ADDRESS_KEY).decode().split()
            self.store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=300))

    @staticmethod
    def _key(version: int) -> str:
        return f"megarl/async/update/{version}"

    def _reach(self) -> dist.TCPStore:
        if self.store is None:
            raise RuntimeError("UpdateSignal: only trainer rank 0 and the rollout ranks hold the signal's store")
        return self.store

    def send(self, version: int) -> None:          # trainer rank 0
        self._reach().set(self._key(version), "1")

    def arrived(self, version: int) -> bool:       # rollout ranks
        return self._reach().check([self._key(version)])

    def take(self, version: int) -> int:           # rollout ranks: wait until it arrives
        while not self.arrived(version):
            time.sleep(0.002)
        return version


__all__ = ["handoff", "send_start", "UpdateSignal"]
