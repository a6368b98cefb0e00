"""The one-node Slurm that launch/slurm/local_cluster.sh starts, for tests/test_launch_slurm.py:
the body of a module-scoped `cluster` fixture (install when missing, start, stop exactly what it
started) and the calls the tests make on it (submit, wait, the job's record and output)."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.checkout import unbuilt_model

CLUSTER = "launch/slurm/local_cluster.sh"


def _two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 60000:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


class Cluster:
    def __init__(self, state_dir: str):
        self.dir = state_dir
        self.env = {**os.environ, "MEGARL_SLURM_DIR": state_dir, "MEGARL_SLURM_PORT": str(_two_free_ports()),
                    # two 1-CPU tasks must fit even on a 1-core runner
                    "MEGARL_SLURM_CPUS": str(max(2, os.cpu_count() or 1))}
        self.env["SLURM_CONF"] = os.path.join(state_dir, "slurm.conf")

    def script(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", CLUSTER, command], env=self.env, capture_output=True, text=True, timeout=timeout)

    def slurm(self, *args: str) -> str:
        out = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{' '.join(args)}: {out.stderr}"
        return out.stdout

    def submit(self, script: str, *args: str, sbatch_flags: tuple = (), entry: str = "megarl.launcher.check",
               env: dict | None = None) -> str:
        job_env = {**self.env, "PYTHON": sys.executable, "MEGARL_ENTRY": entry, **(env or {})}
        if not any("model.path=" in a for a in args):          # not the checkout's runs/models
            args = (*args, *unbuilt_model(self.dir))
        out = subprocess.run(["sbatch", "--parsable", f"--output={self.dir}/slurm-%j.out", *sbatch_flags,
                              script, *args], env=job_env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        fields = self.slurm("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, timeout: float = 120, until=lambda job: job["JobState"] not in
             ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(0.2)
        self.slurm("scancel", job_id)
        raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout}s:\n{self.output(job_id)[-3000:]}")

    def output(self, job_id: str) -> str:
        path = os.path.join(self.dir, f"slurm-{job_id}.out")
        return open(path).read() if os.path.exists(path) else ""


def start_cluster(tmp_path_factory):
    """The body of a module's `cluster` fixture (`yield from start_cluster(tmp_path_factory)`)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("a local Slurm needs Linux and root (slurmd starts job steps as their users)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    c = Cluster(str(tmp_path_factory.mktemp("slurm")))
    begin = time.monotonic()
    got = c.script("install", timeout=900)
    if got.returncode != 0:
        pytest.skip(f"could not install Slurm: {(got.stdout + got.stderr).strip()[-500:]}")
    installed = time.monotonic()
    got = c.script("start", timeout=120)
    if got.returncode != 0:
        c.script("stop", timeout=120)
        pytest.skip(f"the Slurm daemons did not start: {(got.stdout + got.stderr).strip()[-800:]}")
    print(f"\nslurm install {installed - begin:.1f}s, start {time.monotonic() - installed:.1f}s")
    yield c
    stopped = c.script("stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    for name in ("slurmctld", "slurmd"):
        assert not os.path.exists(os.path.join(c.dir, f"{name}.pid"))
