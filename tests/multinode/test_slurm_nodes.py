"""`sbatch --nodes=2 launch/slurm/multi_node.sbatch` on a real two-node Slurm (tests/multinode/slurm.py)
whose NodeNames (cn1, cn2) are not host names, on a CPU partition, with nodes of different sizes.

One cluster serves the module. The ranks run megarl.launcher.check, a small real gloo job.
"""
import os
import socket
import sys
import time

import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.checkout import unbuilt_model
from tests.multinode.slurm import FIRST_JOB_ID, NodeSlurm

pytestmark = pytest.mark.slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs/quickstart.yaml")
SCRIPT = os.path.join(REPO, "launch/slurm/multi_node.sbatch")


@pytest.fixture(scope="module")
def slurm(nodes):
    why = NodeSlurm.refusal()
    if why:
        pytest.skip(why)
    cluster = NodeSlurm(nodes, cpus={1: 4, 2: 2})
    try:
        begin = time.monotonic()
        cluster.start()
        print(f"\ntwo-node slurm up in {time.monotonic() - begin:.1f}s")
        yield cluster
    finally:
        cluster.close()


def submit(slurm, run_dir, *overrides, env=None):
    job_env = {"PYTHON": sys.executable, "MEGARL_ENTRY": "megarl.launcher.check", **(env or {})}
    out = slurm.run("sbatch", "--parsable", "--nodes=2", f"--output={slurm.dir}/slurm-%j.out", SCRIPT, CONFIG,
                    f"trainer.default_local_dir={run_dir}", *overrides, *unbuilt_model(os.path.dirname(run_dir)),
                    env=job_env)
    return out.stdout.strip().split(";")[0]


def in_jobs(nodes):
    return {n.name: n.pids() - {n.holder.pid} for n in nodes}


@pytest.mark.timeout(600)
def test_two_node_sbatch_with_node_names_that_are_not_hosts(nodes, slurm, tmp_path):
    # The port a job-id rule gives the first job (20000 + id % 20000) is taken on its first node:
    # two jobs 20000 ids apart would meet there. The job must pick a free one.
    blocker = slurm.ns.popen(nodes[1], [sys.executable, "-c",
                                        "import socket, time; s = socket.socket(); "
                                        f"s.bind(('', {20000 + FIRST_JOB_ID % 20000})); s.listen(); time.sleep(600)"])
    try:
        slurm.ns.wait_reachable(nodes[2], nodes[1], 20000 + FIRST_JOB_ID % 20000)
        run_dir = tmp_path / "run"
        begin = time.monotonic()
        job_id = submit(slurm, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=3")
        job = slurm.wait(job_id)
        print(f"\ntwo-node sbatch submit-to-complete {time.monotonic() - begin:.1f}s")
    finally:
        slurm.ns.close_proc(blocker)
    out = slurm.output(job_id)
    assert job["JobState"] == "COMPLETED", out[-4000:]
    assert job["NumNodes"] == "2" and job["NodeList"] == "cn[1-2]"
    # No GPU asked on a CPU partition; rendezvous at cn1's NodeAddr, not its NodeName.
    assert f"rendezvous {nodes[1].addr}:" in out, out[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2, 3] and {r["launch/world_size"] for r in records} == {4}
    # The batch node (cn1) has 4 CPUs, cn2 has 2: the torchrun tasks ask what every node holds (2)
    # and each node's 2 ranks get 1 thread each from what its task was granted.
    for rank, node in ((0, "node1"), (2, "node2")):
        assert f"launch_check: rank {rank}/4 local 0 on {node} (1 threads, gloo on eth0)" in out, out[-3000:]
    assert f"megarl: job {job_id} finished" in out

    # A rank killed on the second node: the job fails at once, its last line names node and rank,
    # and nothing of it is left on either node.
    before = in_jobs(nodes)
    begin = time.monotonic()
    job_id = submit(slurm, tmp_path / "killed", "trainer.total_training_steps=300", "trainer.collective_timeout_s=120",
                    env={"MEGARL_CHECK_FAIL": "3:3:kill", "MEGARL_CHECK_STEP_S": "0.1"})
    job = slurm.wait(job_id, timeout=240)
    seconds = time.monotonic() - begin
    print(f"\nrank 3 killed on cn2: submit-to-failed {seconds:.1f}s")
    out = slurm.output(job_id)
    assert job["JobState"] == "FAILED", out[-3000:]
    last = [line for line in out.splitlines() if f"megarl: job {job_id} failed" in line]
    assert len(last) == 1 and "first failure: on node cn2: rank : 3 (local_rank: 1); exitcode : -9" in last[0], \
        out[-3000:]
    assert seconds < 90, f"took {seconds:.0f}s"
    deadline = time.monotonic() + 30
    while in_jobs(nodes) != before and time.monotonic() < deadline:   # slurmstepd ends after the job
        time.sleep(0.5)
    assert in_jobs(nodes) == before


def test_a_master_address_no_node_resolves_is_one_line(nodes, slurm, tmp_path):
    """What a rank would otherwise retry until the join timeout ("gai error -3") stops each node at once."""
    job_id = submit(slurm, tmp_path / "run", "trainer.total_training_steps=2", env={"MASTER_ADDR": "cn1"})
    job = slurm.wait(job_id, timeout=120)
    out = slurm.output(job_id)
    assert job["JobState"] == "FAILED", out[-3000:]
    # Each node stops by itself; which one speaks before srun ends the other varies.
    assert "megarl: MASTER_ADDR=cn1 does not resolve on node" in out, out[-3000:]
    assert "; set it to the first node's address" in out
    assert "first failure: srun: error: cn" in out and ": Exited with exit code 2" in out, out[-3000:]
    assert "launch_check: rank" not in out
    assert socket.gethostname() not in ("node1", "node2")   # the host's own name was never touched
