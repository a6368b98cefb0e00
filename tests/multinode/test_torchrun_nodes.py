"""launch/torchrun.sh across nodes built from namespaces (tests/multinode/nodes.py): real torchrun,
real gloo between two network namespaces, the same command on each node with its NODE_RANK.

One node set serves the module; each test sets the /etc/hosts and mounts it needs. The ranks run
megarl.launcher.check (a small real gloo job) except in the TP2 test, which runs the trainer.
"""
import os
import subprocess
import sys
import time

import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.checkout import unbuilt_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs/quickstart.yaml")


def launch(ns, run_dir, overrides, env=None, timeout=300, nodes=None):
    """NNODES=2 NODE_RANK=i MASTER_ADDR=node0 launch/torchrun.sh on node0 and node1 at once;
    [(exit code, output, seconds)] per node."""
    nodes = nodes or [ns[0], ns[1]]
    if not any("model.path=" in o for o in overrides):       # not the checkout's runs/models
        overrides = [*overrides, *unbuilt_model(os.path.dirname(run_dir))]
    procs, begin = [], time.monotonic()
    for node in nodes:
        node_env = {**os.environ, "PYTHON": sys.executable, "MEGARL_ENTRY": "megarl.launcher.check",
                    "NNODES": str(len(nodes)), "NODE_RANK": str(node.index), "MASTER_ADDR": "node0",
                    "MASTER_PORT": "29611", **(env or {})}
        node_env.pop("GLOO_SOCKET_IFNAME", None)
        procs.append(ns.popen(node, ["bash", f"{REPO}/launch/torchrun.sh", CONFIG,
                                     f"trainer.default_local_dir={run_dir}", *overrides],
                              cwd=REPO, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1, timeout - (time.monotonic() - begin)))
        except subprocess.TimeoutExpired:
            ns.close_proc(proc)
            out, _ = proc.communicate()
            out += f"\n(test: still running after {timeout}s)"
        results.append((proc.returncode, out, time.monotonic() - begin))
    return results


def leftover(ns):
    """Processes still in the nodes besides their holders."""
    return {n.name: n.pids() - {n.holder.pid} for n in ns if n.pids() - {n.holder.pid}}


@pytest.fixture
def loopback_hostnames(nodes):
    """Debian's `127.0.1.1 <hostname>` line in every node's /etc/hosts: gloo left to the hostname
    binds loopback there and its peers get "Connection refused, remote=[127.0.1.1]"."""
    for node in nodes:
        nodes.set_hosts(node, loopback=True)
    yield
    for node in nodes:
        nodes.set_hosts(node)


@pytest.mark.timeout(600)
def test_two_nodes_two_ranks_each_then_a_rank_killed_on_the_second_node(nodes, loopback_hostnames, tmp_path):
    assert nodes[0].run(["getent", "hosts", "node0"]).stdout.startswith("127.0.1.1")
    run_dir = tmp_path / "run"
    results = launch(nodes, run_dir, ["trainer.total_training_steps=3", "trainer.save_freq=3"])
    for rc, out, _ in results:
        assert rc == 0, out[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {r["launch/world_size"] for r in records} == {4}
    assert records[-1]["launch/acc"] == 10 * (1 + 2 + 3)     # (1 + 2 + 3 + 4) x step, summed
    out0, out1 = results[0][1], results[1][1]
    # Each node's ranks say where they run; gloo is bound to the bridge's interface, not to the
    # loopback address the hostname resolves to.
    assert "launch_check: rank 2/4 local 0 on node1" in out1 + out0 and "gloo on eth0) resumes" in out1
    assert "node 1 of 2, rendezvous node0:29611, gloo on eth0" in out1
    assert not leftover(nodes)

    # Rank 3 (node1, local rank 1) dies by SIGKILL at step 3: both nodes stop within seconds,
    # node1's torchrun names it, and nothing is left running on either node.
    results = launch(nodes, tmp_path / "killed", ["trainer.total_training_steps=200",
                                                  "trainer.collective_timeout_s=120"],
                     env={"MEGARL_CHECK_FAIL": "3:3:kill", "MEGARL_CHECK_STEP_S": "0.1"}, timeout=240)
    assert all(rc != 0 for rc, _, _ in results), [r[1][-2000:] for r in results]
    print(f"\nrank 3 killed on node1: both nodes' torchrun ended {max(s for _, _, s in results):.1f}s after start")
    out1 = results[1][1]
    assert "rank      : 3 (local_rank: 1)" in out1 and "Signal 9 (SIGKILL)" in out1, out1[-3000:]
    assert "torchrun exited 1 on node 1 (node1)" in out1
    # Far below the 120 s collective timeout: gloo sees the peer go at once.
    assert max(s for _, _, s in results) < 90, [s for _, _, s in results]
    assert not leftover(nodes)


@pytest.mark.timeout(600)
def test_trainer_with_tp2_split_across_nodes_checks_inputs_once(nodes, tmp_path, addition_model_dir):
    """The real trainer, one rank a node, actor TP 2: each TP group spans both nodes."""
    run_dir = tmp_path / "run"
    calls = tmp_path / "reward-calls"
    reward = tmp_path / "reward.py"
    # Records which process scores and whether its process group is up yet: a call before it is
    # the preflight's one real row, which must happen once for the job, not on every rank.
    reward.write_text(
        "import os\nimport torch.distributed as dist\nfrom megarl.reward.rules import default_compute_score\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(f\"{os.getpid()} {dist.is_available() and dist.is_initialized()}\\n\")\n"
        "    return default_compute_score(data_source, solution_str, ground_truth, extra_info)\n")
    results = launch(nodes, run_dir, [
        f"actor_rollout_ref.model.path={addition_model_dir}", "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2",
        "algorithm.filter_groups.enable=false", f"custom_reward_function.path={reward}",
        "custom_reward_function.name=score"], env={"MEGARL_ENTRY": "megarl.train"}, timeout=420)
    for rc, out, _ in results:
        assert rc == 0, out[-4000:]
    out = results[0][1]
    assert "megarl: training layout: TP 2 x PP 1 x DP 1" in out, out[-3000:]
    assert [r["step"] for r in read_metrics(str(run_dir)) if r["step"] > 0] == [1]
    lines = calls.read_text().split()
    before_training = {pid for pid, up in zip(lines[::2], lines[1::2]) if up == "False"}
    assert len(before_training) == 1, calls.read_text()
    assert not leftover(nodes)


@pytest.mark.timeout(600)
def test_bad_master_addresses_and_node_local_run_dirs(nodes, tmp_path):
    one_rank = ["trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.save_freq=-1"]
    # A first node's name that is loopback on another node, or no name at all: one line, no rank.
    for master, line in (("localhost", "megarl: MASTER_ADDR=localhost is 127.0.0.1 (loopback) on node1, "
                                       "node 1; give the first node's network address"),
                         ("nosuchnode", "megarl: MASTER_ADDR=nosuchnode does not resolve on node1; set it to "
                                        "the first node's address")):
        got = nodes[1].run(["bash", "launch/torchrun.sh", CONFIG, f"trainer.default_local_dir={tmp_path / 'x'}",
                            *one_rank, *unbuilt_model(tmp_path)], cwd=REPO, timeout=120,
                           env={**os.environ, "PYTHON": sys.executable, "NNODES": "2", "NODE_RANK": "1",
                                "MASTER_ADDR": master})
        assert got.returncode == 2 and line in got.stderr, got.stdout + got.stderr
        assert "torch.distributed.run" not in got.stdout + got.stderr

    # Node-local storage: node1 has a /scratch of its own at the same path. The run directory
    # there is not the one rank 0 writes; every node stops at start with one line that says so.
    scratch = tmp_path / "scratch"
    own = tmp_path / "node1-scratch"
    scratch.mkdir()
    own.mkdir()
    nodes[1].bind(str(own), str(scratch))
    try:
        results = launch(nodes, scratch / "run", one_rank, timeout=240)
    finally:
        nodes[1].unbind(str(scratch))
    line = (f"megarl: config error: trainer.default_local_dir: {scratch / 'run'} is not shared between nodes: "
            "rank(s) 1 do not see the file rank 0 wrote there")
    assert all(rc != 0 for rc, _, _ in results), [r[1][-2000:] for r in results]
    assert line + " (this rank, on node1, is one)" in results[1][1], results[1][1][-3000:]
    assert line in results[0][1], results[0][1][-3000:]
    assert "launch_check: done" not in results[0][1] + results[1][1]
    assert not (scratch / "run" / "metrics.jsonl").exists()
    assert not leftover(nodes)
