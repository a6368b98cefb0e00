"""Several "nodes" on one machine, built from Linux namespaces, for tests of multi-node launch.

    with NodeSet(3) as nodes:            # node0, node1, node2 on 10.77.0.0/24
        nodes[1].run(["hostname"])       # -> node1

Each node is a network namespace (`ip netns add`) holding one veth whose other end sits on a
bridge in a namespace of its own, plus a UTS and a mount namespace kept alive by a holder process:
its own hostname, its own /etc/hosts (a bind mount) and, on request, node-local directories (more
bind mounts over a shared path). Commands enter with `nsenter -t <holder>`, not `ip netns exec`,
which remounts /sys and drops /sys/fs/cgroup (slurmd then fails to start).

Nothing is added to the host's own namespace: no interface, no route, no address; the nodes have
no default route, so traffic stays between them. Teardown ends every process inside the nodes' network
namespaces by pid (`ip netns pids`), then deletes the namespaces, which removes the veths and the
bridge with them. Building needs root; `NodeSet.refusal()` says why it cannot be built here.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Node:
    def __init__(self, index: int, netns: str, state: str):
        self.index = index
        self.name = f"node{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.netns = netns
        self.hosts = os.path.join(state, f"hosts-{self.name}")
        self.holder: subprocess.Popen | None = None

    def enter(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """argv as run inside this node (its network, hostname and mounts), in `cwd`."""
        assert self.holder is not None, "node not started"
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--uts", "--mount",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(self, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.enter(argv, kw.pop("cwd", None)), timeout=timeout, **kw)

    def bind(self, source: str, target: str) -> None:
        """Mount `source` over `target` on this node only: node-local storage at a shared path."""
        got = subprocess.run(["nsenter", "-t", str(self.holder.pid), "--mount", "mount", "--bind", source, target],
                             capture_output=True, text=True, timeout=30)
        if got.returncode != 0:
            raise RuntimeError(f"{self.name}: mount --bind {source} {target}: {got.stderr.strip()}")

    def unbind(self, target: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "--mount", "umount", target],
                       capture_output=True, timeout=30)

    def pids(self) -> set[int]:
        """Every process in this node's network namespace, the holder included."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
        return {int(p) for p in out.stdout.split()}


class NodeSet:
    def __init__(self, count: int):
        self.prefix = f"megarl{os.getpid()}"
        self.state = tempfile.mkdtemp(prefix="megarl-nodes-")
        self.bridge = f"{self.prefix}-br"
        self.nodes = [Node(i, f"{self.prefix}-n{i}", self.state) for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __iter__(self):
        return iter(self.nodes)

    @staticmethod
    def refusal() -> str | None:
        """Why namespaces cannot be built here (None: they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "nsenter", "unshare", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        probe = f"megarl{os.getpid()}-probe"
        got = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if got.returncode != 0:
            return f"`ip netns add` is refused here: {got.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None

    def hosts_text(self, loopback_name: str | None = None) -> str:
        lines = ["127.0.0.1 localhost"]
        if loopback_name:   # Debian's installer writes this line for the machine's own name
            lines.append(f"127.0.1.1 {loopback_name}")
        lines += [f"{n.addr} {n.name}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    def set_hosts(self, node: Node, loopback: bool = False) -> None:
        # Written in place (same inode), so the bind mount inside the node sees the new text.
        with open(node.hosts, "w") as f:
            f.write(self.hosts_text(node.name if loopback else None))

    def __enter__(self) -> NodeSet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        _ip("netns", "add", self.bridge)
        self.made.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            self.made.append(node.netns)
            port = f"p{node.index}"
            _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
            self.set_hosts(node)
            # The holder keeps the node's UTS and mount namespaces alive; `exec sleep` makes its pid
            # the one nsenter targets. Private propagation: the node's mounts stay its own.
            setup = f"hostname {node.name} && mount --bind {node.hosts} /etc/hosts && echo up && exec sleep infinity"
            node.holder = subprocess.Popen(["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount",
                                            "--propagation", "private", "sh", "-c", setup],
                                           stdout=subprocess.PIPE, text=True, start_new_session=True)
            if node.holder.stdout.readline().strip() != "up":
                raise RuntimeError(f"{node.name} did not start (exit {node.holder.wait(10)})")

    def popen(self, node: Node, argv: list[str], cwd: str | None = None, **kw) -> subprocess.Popen:
        """A process on `node`, leading a process group of its own; ended by close() if still running."""
        proc = subprocess.Popen(node.enter(argv, cwd), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    @staticmethod
    def close_proc(proc: subprocess.Popen) -> None:
        """End a process started by popen() and everything in its process group."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_reachable(self, src: Node, dst: Node, port: int, timeout: float = 30) -> None:
        """There is no ping here: a TCP connect (refused is fine) shows the path is up."""
        code = (f"import socket,time,sys\nend=time.time()+{timeout}\n"
                f"while time.time()<end:\n"
                f"  try: socket.create_connection(('{dst.addr}',{port}),1).close(); sys.exit(0)\n"
                f"  except ConnectionRefusedError: sys.exit(0)\n"
                f"  except OSError: time.sleep(0.2)\n"
                f"sys.exit(1)")
        assert src.run(["python3", "-c", code], timeout=timeout + 10).returncode == 0, \
            f"{dst.name} not reachable from {src.name}"

    def close(self) -> None:
        for proc in self.procs:
            self.close_proc(proc)
        # Whatever else runs in a node (daemons' children, job steps) is found by its namespace.
        for node in self.nodes:
            if node.netns in self.made:
                for pid in node.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for proc in self.procs + [n.holder for n in self.nodes if n.holder is not None]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        deadline = time.monotonic() + 30
        for name in reversed(self.made):
            while True:   # a namespace goes once its last process is reaped
                got = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)
                if got.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        self.made.clear()
        shutil.rmtree(self.state, ignore_errors=True)
