"""A real Slurm across namespace nodes (tests/multinode/nodes.py): slurmctld on node0, slurmd on
node1 and node2, munged on each with one key.

The Slurm NodeNames are cn1 and cn2, which resolve nowhere; each node's NodeHostname and NodeAddr
say where it is, as on clusters whose scheduler names differ from their hosts' names. The daemons run
in the foreground (`-D`, `-F`) so their pids are ours to end; each node's spool, pid and log files
sit in a node-local directory (a bind mount over one shared path, as slurm.conf names one path).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from tests.multinode.nodes import Node, NodeSet

FIRST_JOB_ID = 4242


class NodeSlurm:
    def __init__(self, ns: NodeSet, cpus: dict[int, int]):
        self.ns = ns
        self.ctl = ns[0]
        self.computes = [ns[i] for i in sorted(cpus)]
        self.cpus = cpus
        self.dir = tempfile.mkdtemp(prefix="megarl-nodeslurm-")   # 0700
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.daemons: list[subprocess.Popen] = []

    @staticmethod
    def refusal() -> str | None:
        for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (launch/slurm/local_cluster.sh install)"
        return None

    def node_name(self, node: Node) -> str:
        return f"cn{node.index}"

    def write_conf(self) -> None:
        d = self.dir
        nodes = "\n".join(f"NodeName={self.node_name(n)} NodeHostname={n.name} NodeAddr={n.addr} "
                          f"CPUs={self.cpus[n.index]} RealMemory=2000 State=UNKNOWN" for n in self.computes)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=megarl-nodes
SlurmctldHost={self.ctl.name}({self.ctl.addr})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SwitchType=switch/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/local/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/local/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/local/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=300
FirstJobId={FIRST_JOB_ID}
{nodes}
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        d = self.dir
        os.makedirs(f"{d}/state", mode=0o700)
        os.makedirs(f"{d}/munge", mode=0o700)
        os.makedirs(f"{d}/local", mode=0o700)
        key = f"{d}/munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=60)
        self.write_conf()
        for node in [self.ctl, *self.computes]:
            # One munged per node, each with its own socket directory mounted at the path slurm.conf names.
            own = f"{d}/munge-{node.name}"
            os.makedirs(own, mode=0o700)
            shutil.copy(key, f"{own}/munge.key")
            os.chmod(f"{own}/munge.key", 0o400)
            node.bind(own, f"{d}/munge")
            local = f"{d}/local-{node.name}"
            os.makedirs(f"{local}/spool", mode=0o700)   # slurmd does not create its spool directory
            node.bind(local, f"{d}/local")
            self.daemon(node, ["munged", "-F", "--force", f"--socket={d}/munge/munge.socket",
                               f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                               f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/munged.seed"])
        for node in [self.ctl, *self.computes]:
            self.wait_for(lambda n=node: n.run(["test", "-S", f"{d}/munge/munge.socket"]).returncode == 0,
                          f"munged on {node.name}")
        self.daemon(self.ctl, ["slurmctld", "-D", "-f", self.conf])
        for node in self.computes:
            self.daemon(node, ["slurmd", "-D", "-f", self.conf, "-N", self.node_name(node)])

        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
            return sum(1 for line in out if line.split()[1:2] == ["idle"]) == len(self.computes)
        self.wait_for(idle, "both slurmd nodes idle", timeout=90)

    def daemon(self, node: Node, argv: list[str]) -> None:
        log = open(os.path.join(self.dir, f"{argv[0]}-{node.name}.out"), "w")
        self.daemons.append(self.ns.popen(node, argv, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[-4:]} exited {proc.returncode} while waiting for {what}; "
                                       f"{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout}s; {self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".out", ".log")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text.append(f"--- {name}\n" + "".join(f.readlines()[-8:]))
        return "\n".join(text)

    def run(self, *argv: str, node: Node | None = None, check: bool = True, env: dict | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command on `node` (default: the controller's)."""
        out = (node or self.ctl).run(list(argv), env={**self.env, **(env or {})}, timeout=timeout)
        assert not check or out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
        return out

    def job(self, job_id: str) -> dict:
        fields = self.run("scontrol", "show", "job", "-o", job_id).stdout.split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return job
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout}s:\n{self.output(job_id)[-3000:]}")

    def output(self, job_id: str) -> str:
        path = os.path.join(self.dir, f"slurm-{job_id}.out")
        return open(path).read() if os.path.exists(path) else ""

    def close(self) -> None:
        """Jobs cancelled, then the daemons ended by pid (the node set ends whatever else is left)."""
        if self.daemons and all(p.poll() is None for p in self.daemons):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 30
                while self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for proc in reversed(self.daemons):    # munged last: slurmd reports its jobs' ends through it
            # SIGTERM first: slurmctld then reaps its own slurmscriptd, which would stay a zombie.
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                self.ns.close_proc(proc)
                proc.wait(30)
        for node in [self.ctl, *self.computes]:
            node.unbind(f"{self.dir}/local")
            node.unbind(f"{self.dir}/munge")
        shutil.rmtree(self.dir, ignore_errors=True)
