"""torch key-value stores that listen on loopback only.

    store = listening_store("127.0.0.1", port=0)     # a TCPStore server on that address only
    store = job_store(timeout)                       # init_process_group's store on one node, or None

torch's TCPStore server binds every interface whatever host it is given (torch 2.13: ss shows
`*:port` for TCPStore("127.0.0.1", ...)); it has no option for the address. It does take a
listening socket (`master_listen_fd`), so megarl binds one itself: on one node the job's store
and the async trainer's update signal then accept local connections only. TCPStore has no
authentication: local users can still reach a loopback port (docs/security.md).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist


def listening_store(host: str, port: int = 0, world_size: int | None = None,
                    timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> dist.TCPStore:
    """A TCPStore server listening on `host:port` only (port 0: a free one; see `.port`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on (it closes it when it is destroyed).
    return dist.TCPStore(host, bound, world_size, True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=False, master_listen_fd=sock.detach())


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def job_store(timeout: datetime.timedelta, env=os.environ) -> dist.TCPStore | None:
    """The store for init_process_group when MASTER_ADDR is a loopback address and the ranks host
    it themselves (no torchrun agent store): rank 0 listens on loopback only, the others connect.
    None otherwise (torch's env:// rendezvous applies)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not is_loopback(env.get("MASTER_ADDR", "")):
        return None
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    host = "127.0.0.1" if host == "localhost" else host
    world = int(env["WORLD_SIZE"])
    if int(env["RANK"]) == 0:
        store = listening_store(host, port, world, timeout)
    else:
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
    return store
