"""Times of the launch path, with megarl.launcher.check as the job (2 ranks, gloo):
a run from start to finish, and from one rank failing (raise / SIGKILL / hang) to every rank gone.

    python benchmarks/launch_times.py                 # launch/torchrun.sh on this machine
    python benchmarks/launch_times.py --slurm         # also sbatch on the cluster in $SLURM_CONF
                                                      # (e.g. launch/slurm/local_cluster.sh start)
    python benchmarks/launch_times.py --smoke         # CI: the SIGKILL case only
The hang case is bounded by trainer.collective_timeout_s (--timeout); the others should not be.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peak_memory import ProcessPeaks  # noqa: E402

ENV = {**os.environ, "PYTHON": sys.executable, "MEGARL_ENTRY": "megarl.launcher.check"}
FAIL_LINE = "fails at step"


def torchrun(run_dir: str, overrides: list[str], env: dict) -> tuple[float, float | None, int]:
    """(seconds start-to-exit, seconds failure-to-exit or None, exit code)."""
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "launch/torchrun.sh", "configs/quickstart.yaml",
                             f"trainer.default_local_dir={run_dir}", *overrides], env={**ENV, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed_at = None
    for line in proc.stdout:
        if failed_at is None and FAIL_LINE in line:
            failed_at = time.monotonic()
    rc = proc.wait()
    end = time.monotonic()
    return end - start, (end - failed_at if failed_at else None), rc


def sbatch(run_dir: str, overrides: list[str], env: dict) -> tuple[float, float | None, str]:
    out_file = os.path.join(run_dir, "slurm.out")
    os.makedirs(run_dir, exist_ok=True)
    start = time.monotonic()
    job = subprocess.run(["sbatch", "--parsable", f"--output={out_file}", "launch/slurm/quickstart.sbatch",
                          f"trainer.default_local_dir={run_dir}/run", *overrides], env={**ENV, **env},
                         capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    failed_at = None
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if failed_at is None and os.path.exists(out_file) and FAIL_LINE in open(out_file).read():
            failed_at = time.monotonic()
        time.sleep(0.05)
    end = time.monotonic()
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    state = state.split("JobState=", 1)[1].split()[0] if "JobState=" in state else "?"
    return end - start, (end - failed_at if failed_at else None), state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slurm", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0, help="trainer.collective_timeout_s for the runs")
    parser.add_argument("--smoke", action="store_true", help="CI: only the SIGKILL case")
    args = parser.parse_args()
    launchers = [("torchrun.sh", torchrun)] + ([("sbatch quickstart", sbatch)] if args.slurm else [])
    cases = [("ok, 5 steps", {}), ("raise", {"MEGARL_CHECK_FAIL": "1:3:raise"}),
             ("SIGKILL", {"MEGARL_CHECK_FAIL": "1:3:kill"}), ("hang", {"MEGARL_CHECK_FAIL": "1:3:hang"})]
    if args.smoke:
        cases = [c for c in cases if c[0] == "SIGKILL"]
    print(f"{'launcher':18} {'case':12} {'start-to-end s':>15} {'failure-to-end s':>17}  result  peak resident MiB")
    for name, launch in launchers:
        for case, env in cases:
            with tempfile.TemporaryDirectory() as tmp, ProcessPeaks() as peaks:
                total = "5" if case.startswith("ok") else "100"
                wall, after_fail, result = launch(tmp, [f"trainer.total_training_steps={total}",
                                                        f"trainer.collective_timeout_s={args.timeout}"],
                                                  {**env, "MEGARL_CHECK_STEP_S": "0.1"})
            after = f"{after_fail:.2f}" if after_fail is not None else "-"
            ranks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(peaks.peak_mb.items()) if k.startswith("rank"))
            print(f"{name:18} {case:12} {wall:15.2f} {after:>17}  {result}  {ranks or '-'}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
