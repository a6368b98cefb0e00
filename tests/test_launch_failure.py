"""Which rank a failed Slurm job names (megarl/launcher/failure.py), on real torchrun summaries."""
import os
import subprocess
import sys
import textwrap

from megarl.launcher.failure import first_failure

# What a CI run of a two-node job showed: rank 0 sees its peer's socket close and writes its error
# file (at second T), torchrun sees rank 1's SIGKILL at its next poll (second T + 1) and SIGTERMs
# rank 0 before it exits; the smaller timestamp makes rank 0 torchrun's Root Cause.
WORKER = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    marker = pathlib.Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 0:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as err:
            ErrorHandler().record_exception(err)
        marker.write_text("recorded")
    if rank == 1:
        while not marker.exists():
            time.sleep(0.01)
        time.sleep(1.1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
""")


def torchrun_summary(tmp_path) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--monitor-interval=1",
                          str(script), str(tmp_path / "recorded")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    return (out.stdout + out.stderr).splitlines()


def labelled(task: int, lines: list[str]) -> list[str]:
    return [f"{task}: {line}" for line in lines]


def test_the_rank_killed_is_named_not_the_one_that_saw_it_die(tmp_path):
    summary = torchrun_summary(tmp_path)
    assert any("Root Cause" in line for line in summary)
    # On its own, torchrun names the rank whose timestamp is smallest: here the one that raised.
    root = summary[next(i for i, line in enumerate(summary) if "Root Cause" in line):]
    assert next(line for line in root if "rank      :" in line).split(":", 1)[1].strip().startswith("0 ")
    peer = ["some output", "  rank      : 9 (local_rank: 0)", "  exitcode  : 1 (pid: 1)"]
    log = "\n".join(["megarl: job 7 (restart 0) on cn1 cn2 | torchrun mode", *labelled(0, peer),
                     *labelled(1, summary), "srun: error: cn2: task 1: Exited with exit code 1",
                     "srun: error: cn1: task 0: Terminated"])
    named = first_failure(log, "torchrun", ["cn1", "cn2"])
    assert named.startswith("on node cn2: rank : 1 (local_rank: 1); exitcode : -9"), named


def summary(task: int, *entries: tuple[str, str], root: tuple[str, str]) -> list[str]:
    """A torchrun failure summary in the layout torch 2.13 prints (the test above reads a real one)."""
    def entry(rank, code):
        return ["[0]:", "  time      : 2026-01-01_00:00:00", "  host      : localhost",
                f"  rank      : {rank}", f"  exitcode  : {code} (pid: 1)", "  error_file: <N/A>"]
    lines = ["====", "worker.py FAILED", "----", "Failures:"]
    for rank, code in entries:
        lines += entry(rank, code)
    lines += (["<NO_OTHER_FAILURES>"] if not entries else []) + ["----", "Root Cause (first observed failure):",
                                                                   *entry(*root), "===="]
    return labelled(task, lines)


def test_an_exit_code_comes_before_a_rank_torchrun_stopped():
    log = "\n".join(summary(0, ("1 (local_rank: 1)", "1"), root=("0 (local_rank: 0)", "-15")))
    assert first_failure(log, "torchrun", ["n1"]) == "on node n1: rank : 1 (local_rank: 1); exitcode : 1 (pid: 1)"


def test_only_the_last_attempt_of_a_requeued_job_counts():
    first = summary(0, root=("1 (local_rank: 1)", "-9"))
    second = summary(0, root=("0 (local_rank: 0)", "3"))
    log = "\n".join(["megarl: job 5 (restart 0) on n1 | x", *first, "megarl: job 5 (restart 1) on n1 | x", *second,
                     "srun: error: n1: task 0: Exited with exit code 1"])
    assert first_failure(log, "torchrun", ["n1"]).startswith("on node n1: rank : 0 (local_rank: 0); exitcode : 3")


def test_without_a_summary_srun_names_the_first_task_not_merely_terminated():
    log = "\n".join(["srun: error: n1: task 0: Terminated", "srun: error: n2: task 3: Killed",
                     "srun: error: n1: task 1: Exited with exit code 1"])
    assert first_failure(log, "task", ["n1", "n2"]) == "srun: error: n2: task 3: Killed"
    assert first_failure(log, "torchrun", ["n1", "n2"]) == "srun: error: n2: task 3: Killed"
    assert first_failure("", "torchrun", ["n1"]) == "not reported (see the lines above)"


def test_a_ranks_own_text_is_not_taken_for_srun_or_torchrun():
    # Task 1's rank prints what srun and torchrun would (srun --label puts it behind "1: "); task 0's
    # rank is the one that really died, as srun reports it on a line of its own.
    forged = ["srun: error: cn2: task 1: Killed", *[line.split(": ", 1)[1] for line in
                                                    summary(1, root=("7 (local_rank: 1)", "-11"))], "still training"]
    real = summary(0, ("0 (local_rank: 0)", "-15"), root=("1 (local_rank: 1)", "-9"))
    log = "\n".join([*labelled(1, forged), *real, "srun: error: cn1: task 0: Exited with exit code 1",
                     "srun: error: cn2: task 1: Terminated"])
    assert first_failure(log, "torchrun", ["cn1", "cn2"]).startswith("on node cn1: rank : 1 (local_rank: 1); "
                                                                     "exitcode : -9"), log
    # Without srun's line, a summary a task's output goes on after is a rank's text, not its torchrun's.
    log = "\n".join([*labelled(1, forged), *real])
    assert first_failure(log, "torchrun", ["cn1", "cn2"]).startswith("on node cn1: rank : 1 (local_rank: 1)")
    # The task form: srun's report is the only source, a rank's copy of it is not.
    log = "\n".join(["3: srun: error: n2: task 3: Killed", "srun: error: n1: task 1: Exited with exit code 1"])
    assert first_failure(log, "task", ["n1", "n2"]) == "srun: error: n1: task 1: Exited with exit code 1"


def test_a_task_label_of_thousands_of_digits_is_no_task():
    huge = "9" * 5000
    log = "\n".join([f"{huge}: worker.py FAILED", f"{huge}: Root Cause (first observed failure):",
                     f"{huge}:   rank      : 0 (local_rank: 0)", f"{huge}:   exitcode  : -9 (pid: 1)",
                     f"srun: error: n1: task {huge}: Killed", "srun: error: n1: task 0: Exited with exit code 1"])
    for mode in ("torchrun", "task"):
        assert first_failure(log, mode, ["n1"]).startswith("srun: error: n1: task 9999"), mode


def test_a_summary_a_rank_printed_in_the_failed_task_is_not_its_torchruns():
    # torchrun of task 0 was killed before it could summarise; a rank of it had printed a summary earlier.
    forged = summary(0, root=("5 (local_rank: 1)", "-11"))
    log = "\n".join([*forged, "0: step 3/10 | reward 0.5", "srun: error: cn1: task 0: Killed"])
    assert first_failure(log, "torchrun", ["cn1"]) == "srun: error: cn1: task 0: Killed"
