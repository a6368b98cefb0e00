"""launch/slurm/*.sbatch on a real one-node Slurm that the test installs and starts itself.

launch/slurm/local_cluster.sh installs Debian's slurmctld, slurmd and slurm-client (apt-get, when
missing), writes a slurm.conf into a temporary directory (munge authentication with a key of its
own, linuxproc, free non-default ports on 127.0.0.1) and starts munged and both daemons; the
module's fixture stops exactly those at the end. Where Slurm
cannot be installed or started (not root, no apt-get, no network), every test here is skipped
with the reason.

The quickstart tests run the real trainer (megarl.train) on a small warm-started model. The
failure-injection and requeue tests run megarl.launcher.check (MEGARL_ENTRY), a real gloo
job that takes megarl-train's arguments plus knobs for slow steps and failing ranks.
"""
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.containers import container_stand_ins, read_log
from tests.helpers.slurm_cluster import start_cluster

pytestmark = pytest.mark.slurm

QUICKSTART = "launch/slurm/quickstart.sbatch"
QUICKSTART_ENTRY = "megarl.train"
SINGLE_NODE = "launch/slurm/single_node.sbatch"
CONFIG = os.path.abspath("configs/quickstart.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory)


def cluster_repo() -> str:
    return os.path.abspath(".")


def steps_of(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(str(run_dir))]


def short_run(addition_model_dir, run_dir, steps):
    return (f"actor_rollout_ref.model.path={addition_model_dir}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
            "algorithm.filter_groups.enable=false")


@pytest.mark.timeout(480)
def test_time_limit_signal_in_a_container_saves_the_step_then_requeues_and_resumes(cluster, addition_model_dir,
                                                                                   tmp_path):
    # The real quickstart in the torchrun form (single_node.sbatch), every srun step inside an
    # apptainer-style prefix (MEGARL_SRUN_PREFIX), on a host without Python. Near its time limit
    # Slurm sends the batch shell USR1 (--signal=B:USR1@600); job.sh passes it to the ranks (torchrun
    # ignores it), which save the step they are in and exit 143; only then does job.sh requeue the
    # job, which resumes there. USR1 goes by hand (scancel --batch, as slurmctld sends it): a time
    # limit is at least a minute, and Slurm may signal up to a minute early. It goes while the ranks'
    # step is starting (a slow container start that ignores USR1, then the ranks' own start-up), so
    # only job.sh's sending it again (MEGARL_STOP_RESEND_S) reaches the ranks.
    root = str(tmp_path / "box")
    os.makedirs(root)
    with open(f"{root}/slow-start", "w") as f:
        f.write(f"#!/usr/bin/env bash\ntrap '' USR1\necho \"$*\" >> {root}/slow-start.log\nsleep 4\nexec \"$@\"\n")
    os.chmod(f"{root}/slow-start", 0o755)
    env = {**container_stand_ins(root), "MEGARL_SRUN_PREFIX": f"{root}/slow-start {root}/apptainer exec --nv "
                                                              f"{root}/image.sif", "MEGARL_STOP_RESEND_S": "2",
           "NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "UCX_NET_DEVICES": "mlx5_0:1",
           "NCCL_TEST_SECRET_TOKEN": "hunter2"}
    run_dir = tmp_path / "run"
    pointer = run_dir / "latest_checkpointed_iteration.txt"
    job_id = cluster.submit(SINGLE_NODE, CONFIG, *short_run(addition_model_dir, run_dir, 8), entry=QUICKSTART_ENTRY,
                            sbatch_flags=("--gpus-per-node=0",), env=env)
    deadline = time.monotonic() + 300
    while "node_env.sh" not in read_log(root, "slow-start.log"):
        assert time.monotonic() < deadline and cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), \
            cluster.output(job_id)[-3000:]
        time.sleep(0.1)
    signalled = time.monotonic()
    cluster.slurm("scancel", "--batch", "--signal=USR1", job_id)
    cluster.wait(job_id, until=lambda j: j["JobState"] == "PENDING" and j["Restarts"] == "1")
    out = cluster.output(job_id)
    print(f"signal to requeued {time.monotonic() - signalled:.1f}s")
    stop = re.search(r"megarl: stopped by SIGUSR1 after step (\d+) of 8; saved (\S+); the same command resumes there",
                     out)
    assert stop and "is near its time limit (" in out and "the ranks save the step they are in" in out, out[-3000:]
    saved = int(stop.group(1))
    assert stop.group(2) == str(run_dir / f"global_step_{saved}") and int(pointer.read_text()) == saved, out[-3000:]
    assert f"job {job_id} stopped for requeue (srun exit 1)" in out      # torchrun's 1 after the ranks' 143
    # torchrun's summary calls the ranks' 143 a failure (its one traceback); no rank had one, none was killed
    assert out.count("Traceback") == 1 and "ChildFailedError" in out and "SIGKILL" not in out, out[-3000:]
    assert set(re.findall(r"exitcode *: (\d+)", out)) == {"143"}, out[-3000:]
    # Slurm holds a requeued job ~2 min; release it (the old credential's revocation has 1 s granularity).
    time.sleep(2)
    cluster.slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now")
    job = cluster.wait(job_id, timeout=300)
    out = cluster.output(job_id)
    assert job["JobState"] == "COMPLETED", out[-3000:]
    resumed = out[out.index(f"job {job_id} (restart 1) on "):]
    assert f"resumed from {run_dir / f'global_step_{saved}'} at step {saved}" in resumed, out[-3000:]
    assert "torchrun mode, 1 x 2 ranks" in resumed and "megarl: training layout: TP 2 x PP 1 x DP 1" in resumed
    # Each start prints the signal's margin beside the last save's time (tests/test_launch_vars.py:
    # the figures); the stop's own save, after step 1's record, is not among them.
    assert out.count("megarl: the stop signal comes 600 s before the time limit (") == 2, out[-3000:]
    steps = steps_of(run_dir)
    assert steps[0] == 0 and set(range(9)) <= set(steps) and max(steps) == 8        # validation at 0
    assert all("critic/score/mean" in r for r in read_metrics(str(run_dir)) if r["step"] > 0)
    assert f"megarl: job {job_id} finished" in (run_dir / "logs" / f"slurm-{job_id}.log").read_text()
    # Every step of both attempts (config check, ranks) ran in the image; the host ran no Python.
    steps_run = read_log(root, "container.log").splitlines()
    checks = [s for s in steps_run if "-m megarl.launcher.vars " in s]
    nodes = [s for s in steps_run if "launch/slurm/node_env.sh" in s]
    assert len(checks) == 2 and len(nodes) == 2 and len(steps_run) == 4, steps_run
    assert all(f"image={root}/image.sif" in s for s in steps_run)
    assert read_log(root, "host-python.log") == ""
    # The NCCL environment, in the first lines of each attempt, without a secret's value.
    net = re.findall(r"0: megarl: network environment on \S+: (.*)", out)
    assert len(net) == 2 and "NCCL_IB_HCA=mlx5_0,mlx5_1" in net[0] and "UCX_NET_DEVICES=mlx5_0:1" in net[0]
    assert "NCCL_TEST_SECRET_TOKEN=<set, not shown>" in net[0] and "hunter2" not in out


@pytest.mark.timeout(240)
def test_pyxis_container_arguments_reach_every_srun_and_the_host_runs_no_python(cluster, tmp_path):
    """MEGARL_SRUN_ARGS on every srun of the task form: the config check, the ranks, and the report
    of the rank that failed (MEGARL_CHECK_FAIL), each in the image; nothing ran Python on the host."""
    root = str(tmp_path / "box")
    os.makedirs(root)
    env = {**container_stand_ins(root), "MEGARL_CHECK_FAIL": "1:2:raise",
           "MEGARL_SRUN_ARGS": f"--container-image='nvcr.io#nvidia/pytorch:25.01-py3' --container-mounts="
                               f"/work:/work,{tmp_path}:{tmp_path},/tmp:/tmp --no-container-mount-home"}
    job_id = cluster.submit(QUICKSTART, "trainer.total_training_steps=3",
                            f"trainer.default_local_dir={tmp_path / 'run'}", env=env)
    job = cluster.wait(job_id)
    out = cluster.output(job_id)
    node = cluster.slurm("sinfo", "-h", "-o", "%n").split()[0]
    assert job["JobState"] == "FAILED", out[-3000:]
    assert f"first failure: srun: error: {node}: task 1: Exited with exit code 1" in out, out[-3000:]
    image = "image=nvcr.io#nvidia/pytorch:25.01-py3"
    sruns = read_log(root, "srun.log").splitlines()
    assert len(sruns) == 3 and all(f"--container-{image}" in s for s in sruns), sruns
    assert all(f"--container-mounts=/work:/work,{tmp_path}:{tmp_path},/tmp:/tmp" in s and
               "--no-container-mount-home" in s for s in sruns), sruns
    steps_run = read_log(root, "container.log").splitlines()
    assert [s.split(" cmd=")[1].split()[:3] for s in steps_run if "task=0" in s] == [
        ["python3", "-m", "megarl.launcher.vars"], [f"{cluster_repo()}/launch/slurm/rank_env.sh", "python3", "-m"],
        ["python3", "-m", "megarl.launcher.failure"]], steps_run
    assert sum("rank_env.sh" in s for s in steps_run) == 2 and all(image in s for s in steps_run)
    assert read_log(root, "host-python.log") == ""


@pytest.mark.timeout(300)
def test_requeued_cancelled_and_resubmitted_job_resumes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    args = ("trainer.total_training_steps=12", "trainer.save_freq=2", f"trainer.default_local_dir={run_dir}")
    slow = {"MEGARL_CHECK_STEP_S": "0.4"}

    def wait_for_checkpoint(step, timeout=90):
        path, deadline = run_dir / "latest_checkpointed_iteration.txt", time.monotonic() + timeout
        while not (path.exists() and int(path.read_text()) >= step):
            assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout}s"
            time.sleep(0.2)
        return int(path.read_text())

    # 1. Near its time limit Slurm sends the batch shell USR1 (--signal=B:USR1@600); it passes it
    # to the ranks (this check job's ranks die of it) and requeues itself. The signal is sent by
    # hand here rather than by waiting out a time limit.
    job_id = cluster.submit(QUICKSTART, *args, env=slow)
    first_ckpt = wait_for_checkpoint(2)
    cluster.slurm("scancel", "--batch", "--signal=USR1", job_id)
    cluster.wait(job_id, until=lambda j: j["JobState"] == "PENDING" and j["Restarts"] == "1")
    # Slurm holds a requeued job ~2 min before it may start again; release it (after the old
    # job's credential revocation, which has a one-second granularity).
    time.sleep(2)
    cluster.slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now")
    cluster.wait(job_id, until=lambda j: j["JobState"] == "RUNNING")

    # 2. scancel mid-run, then submit the same command again.
    second_ckpt = wait_for_checkpoint(first_ckpt + 4)
    cluster.slurm("scancel", job_id)
    assert cluster.wait(job_id)["JobState"] == "CANCELLED"
    resumed_at = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    job2 = cluster.submit(QUICKSTART, *args)
    done = cluster.wait(job2)
    assert done["JobState"] == "COMPLETED", cluster.output(job2)[-3000:]

    out = cluster.output(job_id)
    assert "is near its time limit (" in out and f"job {job_id} (restart 1)" in out
    records = read_metrics(str(run_dir))
    by_run = {}
    for r in records:
        by_run.setdefault((r["launch/job_id"], r["launch/restart_count"]), []).append(r)
    assert list(by_run) == [(job_id, 0), (job_id, 1), (job2, 0)]
    # Each later run starts right after a complete checkpoint of the one before.
    (_, first), (_, requeued), (_, resubmitted) = by_run.items()
    assert requeued[0]["launch/resumed_from"] >= first_ckpt and \
        requeued[0]["step"] == requeued[0]["launch/resumed_from"] + 1
    assert resubmitted[0]["launch/resumed_from"] == resumed_at >= second_ckpt
    assert resubmitted[0]["step"] == resumed_at + 1 and resubmitted[-1]["step"] == 12
    # Steps between a checkpoint and a kill are redone, so the running sum must still be exact.
    assert resubmitted[-1]["launch/acc"] == 3 * sum(range(1, 13))
    assert sorted(set(steps_of(run_dir))) == list(range(1, 13))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, mode, named", [
    (QUICKSTART, "raise", "first failure: srun: error: {host}: task 1: Exited with exit code 1"),
    (QUICKSTART, "kill", "first failure: srun: error: {host}: task 1: Killed"),
    ("launch/slurm/single_node.sbatch", "raise",
     "first failure: on node {host}: rank : 1 (local_rank: 1); exitcode : 1"),
])
def test_a_failed_rank_fails_the_job_quickly_and_is_named(cluster, tmp_path, script, mode, named):
    run_dir = tmp_path / "run"
    config = () if script == QUICKSTART else (CONFIG,)
    begin = time.monotonic()
    job_id = cluster.submit(script, *config, "trainer.total_training_steps=200", "trainer.collective_timeout_s=120",
                            f"trainer.default_local_dir={run_dir}", sbatch_flags=("--gpus-per-node=0",),
                            env={"MEGARL_CHECK_FAIL": f"1:3:{mode}", "MEGARL_CHECK_STEP_S": "0.1"})
    job = cluster.wait(job_id)
    seconds = time.monotonic() - begin
    print(f"\n{script} {mode}: submit-to-failed {seconds:.1f}s")
    out = cluster.output(job_id)
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", out[-3000:]
    node = cluster.slurm("sinfo", "-h", "-o", "%n").split()[0]
    assert named.format(host=node) in out, out[-3000:]
    if mode == "raise":
        assert "RuntimeError: injected failure on rank 1 at step 3" in out
    assert steps_of(run_dir)[-1] <= 3 and "launch_check: done" not in out
    # Far below the 120 s collective timeout: the dead peer is seen at once and srun ends the rest.
    assert seconds < 60, f"took {seconds:.0f}s"


@pytest.mark.timeout(300)
def test_multi_node_scripts_start_ranks_both_ways(cluster, tmp_path):
    """multi_node.sbatch (srun task per node -> torchrun, static rendezvous on the first node) and
    multi_node_task_per_gpu.sbatch (srun task per rank), each on this one node, CPU only."""
    for script, flags, mode in (("launch/slurm/multi_node.sbatch", (), "torchrun mode"),
                                ("launch/slurm/multi_node_task_per_gpu.sbatch", ("--ntasks-per-node=2",), "task mode")):
        run_dir = tmp_path / script.split("/")[-1]
        job_id = cluster.submit(script, CONFIG, "trainer.total_training_steps=2",
                                f"trainer.default_local_dir={run_dir}",
                                sbatch_flags=("--nodes=1", "--gpus-per-node=0", *flags))
        job = cluster.wait(job_id)
        out = cluster.output(job_id)
        assert job["JobState"] == "COMPLETED", out[-3000:]
        assert f"{mode}, 1 x 2 ranks" in out
        assert steps_of(run_dir) == [1, 2]
        assert {r["launch/world_size"] for r in read_metrics(str(run_dir))} == {2}


@pytest.mark.timeout(120)
def test_bad_config_or_layout_fails_before_ranks_start(cluster, tmp_path):
    cases = [
        (("actor_rollout_ref.rollout.tmperature=1",),
         "megarl: config error: actor_rollout_ref.rollout.tmperature: unknown key; did you mean"),
        # 2 tasks were granted, the override asks for 4 ranks per node
        (("trainer.n_gpus_per_node=4",), "megarl: config error: trainer.n_gpus_per_node: is 4, but this allocation "
                                         "(1 node(s), 2 task(s)) starts 2 process(es) per node"),
    ]
    for overrides, message in cases:
        job_id = cluster.submit(QUICKSTART, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}")
        job = cluster.wait(job_id)
        out = cluster.output(job_id)
        assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", out
        assert message in out, out
        assert "srun" not in out and not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_a_time_limit_within_the_signal_margin_or_unsplittable_container_args_stop_at_start(cluster, tmp_path):
    """Each before any srun: a time limit the USR1 margin would fill (the job would save and
    requeue itself forever), a MEGARL_SRUN_ARGS with an unbalanced quote, a resend interval of 0."""
    cases = [(("--time=10",), {}, "megarl: the time limit (00:10:00) is not above the 600 s stop signal margin "
                                   "plus a minute: ask for more time (--time) or pass --signal=B:USR1@S with "
                                   "MEGARL_SIGNAL_MARGIN_S=S"),
             ((), {"MEGARL_SRUN_ARGS": "--container-image='nvcr.io#nvidia/pytorch"},
              "megarl: MEGARL_SRUN_ARGS=--container-image='nvcr.io#nvidia/pytorch: cannot split it into words"),
             ((), {"MEGARL_STOP_RESEND_S": "0"}, "megarl: MEGARL_STOP_RESEND_S=0: give whole seconds, e.g. 30")]
    for flags, env, message in cases:
        job_id = cluster.submit(QUICKSTART, f"trainer.default_local_dir={tmp_path / 'run'}", sbatch_flags=flags,
                                env=env)
        job = cluster.wait(job_id)
        out = cluster.output(job_id)
        assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0" and message in out, out
        assert "srun" not in out and not (tmp_path / "run").exists()


def test_local_cluster_script_reports_its_daemons(cluster):
    got = cluster.script("status", timeout=60)
    assert got.returncode == 0
    assert "slurmctld running" in got.stdout and "slurmd running" in got.stdout and "idle" in got.stdout
    conf = open(cluster.env["SLURM_CONF"]).read()
    for line in ("AuthType=auth/munge", "CredType=cred/munge", "ProctrackType=proctrack/linuxproc",
                 f"SlurmctldPort={cluster.env['MEGARL_SLURM_PORT']}",
                 f"StateSaveLocation={cluster.dir}/state"):
        assert line in conf
    assert shlex.split(cluster.slurm("sinfo", "-h", "-o", "%c"))[0] == cluster.env["MEGARL_SLURM_CPUS"]


def test_local_cluster_authenticates_with_munge_and_listens_on_loopback(cluster, tmp_path):
    """A client holding another munge key is refused; the daemons listen on 127.0.0.1 only."""
    munge_dir = os.path.join(cluster.dir, "munge")
    assert os.stat(cluster.dir).st_mode & 0o777 == 0o700 and os.stat(munge_dir).st_mode & 0o777 == 0o700
    assert "munged running" in cluster.script("status", timeout=60).stdout
    port = int(cluster.env["MEGARL_SLURM_PORT"])
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.split("\n")
    local = [line.split()[3] for line in listening
             if line.split() and line.split()[3].endswith((f":{port}", f":{port + 1}"))]
    assert sorted(local) == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], local
    # The same cluster seen through a munged with a different key: every request is refused.
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    subprocess.run(["mungekey", "--create", f"--keyfile={other}/munge.key"], check=True)
    subprocess.run(["munged", "--force", f"--socket={other}/sock", f"--key-file={other}/munge.key",
                    f"--pid-file={other}/pid", f"--log-file={other}/log", f"--seed-file={other}/seed"], check=True)
    try:
        conf = open(cluster.env["SLURM_CONF"]).read().replace(f"socket={munge_dir}/munge.socket",
                                                              f"socket={other}/sock")
        (other / "slurm.conf").write_text(conf)
        env = {**cluster.env, "SLURM_CONF": str(other / "slurm.conf")}
        log = os.path.join(cluster.dir, "slurmctld.log")
        seen = os.path.getsize(log)
        got = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=60)
        assert got.returncode != 0, got
        with open(log) as f:
            f.seek(seen)
            assert "Munge decode failed: Invalid credential" in f.read()     # slurmctld's own reason
        assert subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, timeout=60).returncode == 0
    finally:
        subprocess.run(["kill", open(other / "pid").read().strip()])


def test_torchrun_mode_uses_the_static_rendezvous_with_each_node_rank():
    """No Slurm needed: job.sh's torchrun command names the static rendezvous (the c10d one unpickles
    what anyone writes to its store on MASTER_PORT, docs/security.md), and node_env.sh hands each
    node's torchrun its SLURM_NODEID as --node-rank."""
    text = open("launch/slurm/job.sh").read()
    torchrun = text[text.index("-m torch.distributed.run"):text.index("fi\n", text.index("-m torch.distributed.run"))]
    assert "--rdzv-backend=static" in torchrun and "c10d" not in torchrun and "node_env.sh" in text
    parse = ("import sys; from torch.distributed.run import get_args_parser; "
             "print(get_args_parser().parse_args(sys.argv[1:]).node_rank)")
    out = subprocess.run(["bash", "launch/slurm/node_env.sh", sys.executable, "-c", parse, "--rdzv-backend=static",
                          "--nnodes=4", "train.py"], env={**os.environ, "SLURM_NODEID": "3"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr[-2000:]
