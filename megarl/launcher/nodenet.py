"""The interface and address this node's ranks use to reach the other nodes, for a multi-node launch.

    python -m megarl.launcher.nodenet --master-addr node0 --node-rank 1
prints `IFNAME ADDRESS` (e.g. `eth0 10.0.0.2`); launch/common.sh exports GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME from it (unless set) and hands ADDRESS to torchrun as --local-addr.

Left alone, gloo binds the address the node's own hostname resolves to; on a machine with a
Debian-style `127.0.1.1 <hostname>` line in /etc/hosts that is loopback, and every peer then
fails with "Connection refused, remote=[127.0.1.1]". The interface that routes to the first node
is the one the others can reach back. A problem is one line (exit 2) naming it and the fix.
"""
from __future__ import annotations

import argparse
import fcntl
import ipaddress
import socket
import struct
import sys

SIOCGIFADDR = 0x8915


class NodeNetError(Exception):
    pass


def resolve(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError:
        raise NodeNetError(f"MASTER_ADDR={host} does not resolve on {socket.gethostname()}; set it to the first "
                           "node's address or a name every node resolves (under Slurm: its NodeAddr)") from None


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (SIOCGIFADDR; no `ip` needed)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def source_address(dest: str) -> str:
    """The address the kernel would send from to reach `dest` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest, 9))
        except OSError as err:
            raise NodeNetError(f"no route from {socket.gethostname()} to the first node {dest} ({err.strerror}); "
                               "check MASTER_ADDR and this node's network") from None
        return s.getsockname()[0]


def pick(master_addr: str, node_rank: int) -> tuple[str, str]:
    master_ip = resolve(master_addr)
    addrs = interface_addresses()
    here = socket.gethostname()
    if ipaddress.ip_address(master_ip).is_loopback:
        if node_rank != 0:
            raise NodeNetError(f"MASTER_ADDR={master_addr} is {master_ip} (loopback) on {here}, node {node_rank}; "
                               "give the first node's network address")
        # The first node's own name maps to loopback here (Debian's 127.0.1.1 line): the others
        # reach it through its one network interface; with several, only the user knows which.
        outside = {n: a for n, a in addrs.items() if not ipaddress.ip_address(a).is_loopback}
        if len(outside) != 1:
            raise NodeNetError(f"MASTER_ADDR={master_addr} is {master_ip} (loopback) on {here} and it has "
                               f"{len(outside)} other interfaces ({', '.join(outside) or 'none'}); set "
                               "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to the one other nodes reach")
        return next(iter(outside.items()))
    src = source_address(master_ip)
    for name, addr in addrs.items():
        if addr == src:
            return name, addr
    raise NodeNetError(f"{here} reaches {master_addr} from {src}, which no interface holds; set GLOO_SOCKET_IFNAME "
                       "(and NCCL_SOCKET_IFNAME) to the interface other nodes reach")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.launcher.nodenet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        name, addr = pick(args.master_addr, args.node_rank)
    except NodeNetError as err:
        print(f"megarl: {err}", file=sys.stderr)
        return 2
    print(name, addr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
