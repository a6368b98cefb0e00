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


def resolve(host: str) -> tuple[str, tuple]:
    """(address, socket address) of `host`: a name, an IPv4 or IPv6 literal, the latter bare or in
    brackets as URLs write it ("[fd00::1]"); IPv4 first where a name has both."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        found = socket.getaddrinfo(bare, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        found = []
    if not found:
        raise NodeNetError(f"MASTER_ADDR={host} does not resolve on {socket.gethostname()}; set it to the first "
                           "node's address or a name every node resolves (under Slurm: its NodeAddr)")
    family, _, _, _, sockaddr = min(found, key=lambda info: info[0] != socket.AF_INET)
    return str(sockaddr[0]), (family, sockaddr)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address.split("%", 1)[0])      # an IPv6 scope ("%eth0") is no part of it


def interface_addresses() -> dict[str, list[str]]:
    """The addresses of each interface: IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6 (no `ip` needed)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    try:
        with open("/proc/net/if_inet6") as f:
            for row in f:              # "fd000000000000000000000000000002 03 40 00 80 eth0"
                fields = row.split()
                if len(fields) == 6 and len(fields[0]) == 32:
                    found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:                    # a kernel without IPv6
        pass
    return found


def source_address(dest: tuple) -> str:
    """The address the kernel would send from to reach `dest` (a UDP connect sends nothing)."""
    family, sockaddr = dest
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((sockaddr[0], 9, *sockaddr[2:]))
        except OSError as err:
            raise NodeNetError(f"no route from {socket.gethostname()} to the first node {sockaddr[0]} "
                               f"({err.strerror}); check MASTER_ADDR and this node's network") from None
        return str(s.getsockname()[0])


def pick(master_addr: str, node_rank: int) -> tuple[str, str]:
    master_ip, dest = resolve(master_addr)
    here = socket.gethostname()
    if _ip(master_ip).is_unspecified:
        # 0.0.0.0 / :: means "any address" to a server binding it, and no address to a peer that
        # must connect: every node but the first would wait on a rendezvous it cannot reach.
        raise NodeNetError(f"MASTER_ADDR={master_addr} is {master_ip}, the unspecified address, which other nodes "
                           f"cannot connect to (on {here}, node {node_rank}); give the first node's network address "
                           "or a name every node resolves")
    addrs = [(name, a) for name, found in interface_addresses().items() for a in found]
    if _ip(master_ip).is_loopback:
        if node_rank != 0:
            raise NodeNetError(f"MASTER_ADDR={master_addr} is {master_ip} (loopback) on {here}, node {node_rank}; "
                               "give the first node's network address")
        # The first node's own name maps to loopback here (Debian's 127.0.1.1 line): the others
        # reach it through its one network interface; with several, only the user knows which.
        # Link-local IPv6 addresses are on every interface and route nowhere beyond it.
        same = [(n, a) for n, a in addrs if _ip(a).version == _ip(master_ip).version]
        outside = dict(reversed([(n, a) for n, a in same if not _ip(a).is_loopback and not _ip(a).is_link_local]))
        if len(outside) != 1:
            raise NodeNetError(f"MASTER_ADDR={master_addr} is {master_ip} (loopback) on {here} and it has "
                               f"{len(outside)} other interfaces ({', '.join(outside) or 'none'}); set "
                               "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to the one other nodes reach")
        return next(iter(outside.items()))
    src = source_address(dest)
    for name, addr in addrs:
        if _ip(addr) == _ip(src):
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
