"""No store a run opens turns a client's write into code: a real 2-rank `megarl-train` run, every
TCP port its processes listen on tried as a torch key-value store, every key found overwritten with
a pickle that would create a marker file, and the run must go on (past c10d's 5 s re-read, three
more steps) without running it; started by
`megarl-train` and by launch/torchrun.sh. (launch/slurm/job.sh's torchrun mode: test_launch_slurm.py.)
The `megarl-train` run then serves a second check, which needs a healthy 2-rank run past its start
and nothing more: a rank that stops (SIGSTOP: alive, silent) fails the others within
trainer.collective_timeout_s, with one line naming the timeout and its key.

torchrun's c10d rendezvous keeps its state pickled (base64) under `torch.rendezvous.<id>` and
unpickles it every few hundred milliseconds; the stores accept anyone who can reach the port. Each
launch path uses the static rendezvous instead, whose store holds JSON and plain bytes.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults.runs import Launch, overrides, run_processes


class _Touch:
    """Unpickling this runs `touch <path>`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def listening_ports(tag: str) -> set[tuple[str, int]]:
    found = set()
    for p in run_processes(tag):
        try:
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                host = c.laddr.ip
                found.add(("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, c.laddr.port))
    return found


def rendezvous_ids(tag: str) -> set[str]:
    """The run ids torchrun was given (`none` when it was given none): c10d's key is torch.rendezvous.<id>."""
    ids = {"none"}
    for p in run_processes(tag):
        try:
            args = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for i, arg in enumerate(args):
            for flag in ("--rdzv-id", "--rdzv_id"):
                if arg.startswith(flag + "="):
                    ids.add(arg.split("=", 1)[1])
                elif arg == flag and i + 1 < len(args):
                    ids.add(args[i + 1])
    return ids


ATTACHER = """
import base64, datetime, json, os, sys
from concurrent.futures import ThreadPoolExecutor, wait
import torch.distributed as dist
job = json.load(sys.stdin)
raw, names = base64.b64decode(job["raw"]), set(job["names"])
def attach(address):
    try:
        store = dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=2),
                              wait_for_workers=False)
        keys = set(store.list_keys())
    except Exception:       # gloo's listeners and anything else that is not a store
        return None
    for key in keys | names:
        store.set(key, base64.b64encode(raw) if key.startswith("torch.rendezvous.") else raw)
    return f"{address[0]}:{address[1]}", sorted(keys | names)
pool = ThreadPoolExecutor(max(1, len(job["ports"])))
done, _ = wait([pool.submit(attach, tuple(port)) for port in job["ports"]], timeout=job["attach_s"])
print(json.dumps(dict(found for future in done if (found := future.result()))), flush=True)
os._exit(0)
"""


def poison(tag: str, ports: set[tuple[str, int]], marker) -> dict:
    """Overwrite every key of every store among `ports` (the run's listening ports): raw pickles,
    and c10d's base64 form under the rendezvous key names. Returns {address: keys written}.

    All ports at once, from a child process that waits ATTACH_S and then exits: a store answers
    within milliseconds, while a port that is not one (gloo's listeners reset the client) costs
    ~36 s of torch's own connection retries (the 2 s timeout bounds each try, not the retrying),
    which the child's exit ends. The caller tries again if no store answered in time."""
    job = {"raw": base64.b64encode(pickle.dumps(_Touch(marker))).decode(), "attach_s": ATTACH_S,
           "names": sorted(f"torch.rendezvous.{i}" for i in rendezvous_ids(tag)),
           "ports": sorted(ports)}
    out = subprocess.run([sys.executable, "-c", ATTACHER], input=json.dumps(job), capture_output=True,
                         text=True, timeout=ATTACH_S + 120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


ATTACH_S = 8


def last_step(run_dir) -> int:
    steps = [int(m) for log in run_dir.glob("logs/*.log")
             for m in re.findall(rf"step (\d+)/{STEPS} ", log.read_text(errors="replace"))]
    return max(steps, default=0)


STEPS = 200     # long enough to outlast the writes, the steps after them and a stopped rank


STOP_TIMEOUT_S = 15      # above the longest gap between two collectives of a loaded 2-core machine


def poisoned_run_goes_on(launch, run_dir, marker) -> None:
    """Once the run is past its first steps, write a pickle into every store it listens on; the run
    must go on past c10d's re-read and three more steps without running it. Leaves the run going
    unless it ended (well) on its own meanwhile."""
    deadline = time.monotonic() + 300
    while last_step(run_dir) < 2:                # past start-up, every store open, ~1 s a step from here
        assert launch.proc.poll() is None, launch.finish()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach its first step"
        time.sleep(0.2)
    # A loaded machine can let one attach time out: try again while the run is still going.
    ports, written = set(), {}
    for _ in range(4):
        ports = listening_ports(launch.tag)
        written = poison(launch.tag, ports, marker)
        if written or launch.proc.poll() is not None:
            break
    assert written, f"no store found among {sorted(ports)}"
    # c10d's agent re-reads its state every 5 s at the latest: the run must go on past that, and
    # three more steps, with nothing run.
    after = last_step(run_dir)
    time.sleep(6)
    deadline = time.monotonic() + 120
    while launch.proc.poll() is None and last_step(run_dir) < after + 3:
        assert time.monotonic() < deadline, "the run stopped making steps after the writes"
        time.sleep(0.2)
    assert not marker.exists(), f"a pickle written to {sorted(written)} ran in the run"
    if launch.proc.poll() is not None:        # it finished while the writes went on: it must have ended well
        rc, out = launch.finish()
        assert rc == 0 and last_step(run_dir) == STEPS, out[-3000:]


@pytest.mark.timeout(600)
def test_a_store_client_cannot_run_code_in_a_run_of_launch_torchrun_sh(addition_model_dir, tmp_path):
    marker, run_dir = tmp_path / "code-ran", tmp_path / "run"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS, "trainer.save_freq=-1"), script=True)
    try:
        poisoned_run_goes_on(launch, run_dir, marker)
    finally:                                  # the rest of its steps prove nothing
        if launch.proc.poll() is None:
            launch.kill_group()
    assert not marker.exists(), "a pickle written to a store ran in the run"


def _rank_pid(tag: str, rank: int) -> int:
    for p in run_processes(tag):
        env = p.environ()
        if env.get("RANK") == str(rank) and "megarl.train" in p.cmdline():
            return p.pid
    raise AssertionError(f"rank {rank} not found")


@pytest.mark.timeout(600)
def test_a_store_client_cannot_run_code_in_megarl_train_and_a_stopped_rank_fails_the_others(
        addition_model_dir, tmp_path):
    marker, run_dir = tmp_path / "code-ran", tmp_path / "run"
    launch = Launch(overrides(addition_model_dir, run_dir, STEPS, "trainer.save_freq=-1",
                              f"trainer.collective_timeout_s={STOP_TIMEOUT_S}"))
    try:
        poisoned_run_goes_on(launch, run_dir, marker)
        assert launch.proc.poll() is None, "the run ended before rank 1 could be stopped (raise STEPS)"
        stopped = time.monotonic()
        os.kill(_rank_pid(launch.tag, 1), signal.SIGSTOP)
        try:
            rc, out = launch.finish(timeout=STOP_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_TIMEOUT_S + 60}s after rank 1 stopped (trainer.collective_timeout_s="
                        f"{STOP_TIMEOUT_S}); a group ignores the collective timeout")
        seconds = time.monotonic() - stopped
    finally:
        if launch.proc.poll() is None:
            launch.kill_group()
    assert not marker.exists(), "a pickle written to a store ran in the run"
    assert rc != 0
    assert f"a collective waited past trainer.collective_timeout_s={STOP_TIMEOUT_S}s" in out, out[-3000:]
    assert seconds < STOP_TIMEOUT_S + 45, f"took {seconds:.0f}s"
