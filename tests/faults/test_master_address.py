"""The master address a multi-node launch is given (megarl/launcher/nodenet.py, run by
launch/common.sh on every node): the unspecified address is refused in one line, and IPv6 masters,
bare or in brackets, resolve to the interface that reaches them. Real sockets and interfaces."""
import ipaddress
import subprocess
import sys

import pytest

from megarl.launcher.nodenet import interface_addresses


def nodenet(addr: str, node_rank: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.launcher.nodenet", "--master-addr", addr,
                           "--node-rank", str(node_rank)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "[::]", "0"])
def test_the_unspecified_address_is_refused_in_one_line(addr):
    for node_rank in (1, 0):
        out = nodenet(addr, node_rank)
        assert out.returncode == 2 and not out.stdout, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "the unspecified address" in lines[0], lines
        assert "give the first node's network address" in lines[0]


def ipv6_addresses() -> list[tuple[str, str]]:
    return [(name, a) for name, found in interface_addresses().items() for a in found
            if ipaddress.ip_address(a).version == 6 and not ipaddress.ip_address(a).is_link_local
            and not ipaddress.ip_address(a).is_loopback]


def test_an_ipv6_master_resolves_bare_and_in_brackets():
    found = ipv6_addresses()
    if not found:
        pytest.skip("this machine has no routable IPv6 address to be the master")
    name, addr = found[0]
    for given in (addr, f"[{addr}]", str(ipaddress.ip_address(addr).exploded)):
        out = nodenet(given, 1)
        assert out.returncode == 0, out.stderr
        got_name, got_addr = out.stdout.split()
        assert got_name == name and ipaddress.ip_address(got_addr) == ipaddress.ip_address(addr)


def test_the_ipv6_loopback_is_refused_off_the_first_node_as_ipv4s_is():
    for given in ("::1", "[::1]"):
        out = nodenet(given, 1)
        assert out.returncode == 2 and "(loopback)" in out.stderr and "does not resolve" not in out.stderr, out.stderr


def test_a_name_that_does_not_resolve_is_one_line():
    out = nodenet("no-such-node.invalid", 1)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "does not resolve" in out.stderr
