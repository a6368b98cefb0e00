"""The variables a launcher needs, from a config checked exactly as megarl-train checks it.

    python -m megarl.launcher.vars --config configs/quickstart.yaml [overrides ...] \
        [--nnodes N] [--nproc-per-node P] [--by "what starts them"] [--free-port] [--signal-margin-s S]

prints shell assignments (MEGARL_RUN_DIR=..., MEGARL_NPROC_PER_NODE=..., ...); with
`--env-file PATH` it writes them to PATH instead, as NUL-separated name/value pairs, which
launch/common.sh reads without `eval`. `--env-file -` writes the pairs to stdout and sends whatever
else reaches stdout meanwhile (a print in a user's reward file, from Python or C) to stderr: that is
how launch/slurm/job.sh reads them back through `srun` from inside a container. It validates the
whole config first, so a bad key or a layout that the allocation cannot hold stops the job with one
line before any rank starts.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys

from megarl.config import ConfigError
from megarl.job.launch_env import check_launch, shell_assignments
from megarl.launcher.preflight import node_checks, preflight
from megarl.launcher.cli import load_checked  # the exact checks megarl-train applies
from megarl.storage.durable import make_private_dir

TAIL_BYTES = 1 << 20      # metrics.jsonl's last MiB holds the last save of any run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.launcher.vars", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c")
    parser.add_argument("--nnodes", type=int, help="nodes the launcher runs on (checked against trainer.nnodes)")
    parser.add_argument("--nproc-per-node", type=int, help="processes it starts per node (checked)")
    parser.add_argument("--by", default="the launcher")
    parser.add_argument("--node-only", action="store_true",
                        help="check only this node's part (devices, run directory): another node checks the inputs")
    parser.add_argument("--env-file", help="write NAME\\0VALUE\\0 pairs here (- for stdout) instead of assignments")
    parser.add_argument("--free-port", action="store_true", help="also MEGARL_FREE_PORT: a TCP port free on this node")
    parser.add_argument("--signal-margin-s", type=float,
                        help="seconds the ranks get between the stop signal and the kill: printed beside the last "
                             "save and step times, with a warning when they do not fit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = _own_stdout() if args.env_file == "-" else None
    try:
        cfg = load_checked(args.config, args.overrides, check_all=False)
        check_launch(cfg, args.nnodes, args.nproc_per_node, by=args.by)
        (node_checks if args.node_only else preflight)(cfg)  # after the layout check
        # A launch, not --check: the run directory is made here, 0700, before the script's mkdir -p of
        # its logs would make it with the shell's umask.
        for path in (cfg.trainer.default_local_dir, cfg.trainer.log_dir):
            if path:
                make_private_dir(path)
    except ConfigError as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    values = shell_assignments(cfg)
    if args.free_port:
        values["MEGARL_FREE_PORT"] = str(free_port())
    if args.signal_margin_s is not None:
        for line in stop_margin_lines(cfg, args.signal_margin_s):
            print(line, file=sys.stderr, flush=True)
    pairs = b"".join(f"{k}\0{v}\0".encode() for k, v in values.items())
    if out is not None:
        sys.stdout.flush()
        os.write(out, pairs)
        return 0
    if args.env_file:
        with open(args.env_file, "wb") as f:
            f.write(pairs)
        return 0
    for key, value in values.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


def _own_stdout() -> int:
    """A copy of fd 1 for the pairs alone; fd 1 itself then points at stderr, so no other output,
    Python's or a C library's, lands among them."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    return kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def stop_margin_lines(cfg, margin_s: float) -> list[str]:
    """What the last run in this run directory spent on a save and a step, against the time the
    stop signal leaves (a step runs to its end, then the save): one line, and a warning line when
    the margin is shorter than both together or the step longer than trainer.stop_grace_s."""
    tr = cfg.trainer
    where = os.path.join(tr.log_dir or tr.default_local_dir, "metrics.jsonl")
    head = (f"megarl: the stop signal comes {margin_s:g} s before the time limit (MEGARL_SIGNAL_MARGIN_S, "
            f"sbatch --signal=B:USR1@{margin_s:g})")
    save_s, step_s, step = _last_save(where)
    if save_s is None:
        return [f"{head}; {where} records no save yet"]
    lines = [f"{head}; the last save took {save_s:.1f} s and a step {step_s:.1f} s (step {step} in {where})"]
    if save_s + step_s > margin_s or step_s > tr.stop_grace_s:
        lines.append(f"megarl: warning: a step plus a save ({step_s + save_s:.0f} s) does not fit the "
                     f"{margin_s:g} s margin or a step exceeds trainer.stop_grace_s={tr.stop_grace_s:g}: a "
                     "stop would save nothing; raise --signal's @seconds with MEGARL_SIGNAL_MARGIN_S (and "
                     "trainer.stop_grace_s)")
    return lines


def _last_save(path: str) -> tuple[float | None, float, int]:
    """timing_s/save_checkpoint of the newest record that has one, with its timing_s/step and step."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return None, 0.0, 0
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
            save_s = float(record["timing_s/save_checkpoint"])
        except (ValueError, KeyError, TypeError):
            continue      # a torn first line, a record without a save
        return save_s, float(record.get("timing_s/step", 0.0)), int(record.get("step", 0))
    return None, 0.0, 0


if __name__ == "__main__":
    sys.exit(main())
