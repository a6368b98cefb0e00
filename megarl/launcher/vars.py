"""The variables a launcher needs, from a config checked exactly as megarl-train checks it.

    python -m megarl.launcher.vars --config configs/quickstart.yaml [overrides ...] \
        [--nnodes N] [--nproc-per-node P] [--by "what starts them"]

prints shell assignments (MEGARL_RUN_DIR=..., MEGARL_NPROC_PER_NODE=..., ...); with
`--env-file PATH` it writes them to PATH instead, as NUL-separated name/value pairs, which
launch/common.sh reads without `eval` (a print in a user's reward file reaches the terminal and
nothing else). It validates the whole config first, so a bad
key or a layout that the allocation cannot hold stops the job with one line before any rank starts.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from megarl.config import ConfigError
from megarl.trainer.launch_env import check_launch, shell_assignments
from megarl.launcher.preflight import node_checks, preflight
from megarl.launcher.cli import load_checked  # the exact checks megarl-train applies
from megarl.storage.durable import make_private_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.launcher.vars", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c")
    parser.add_argument("--nnodes", type=int, help="nodes the launcher runs on (checked against trainer.nnodes)")
    parser.add_argument("--nproc-per-node", type=int, help="processes it starts per node (checked)")
    parser.add_argument("--by", default="the launcher")
    parser.add_argument("--node-only", action="store_true",
                        help="check only this node's part (devices, run directory): another node checks the inputs")
    parser.add_argument("--env-file", help="write NAME\\0VALUE\\0 pairs here instead of printing assignments")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
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
    if args.env_file:
        with open(args.env_file, "wb") as f:
            f.write(b"".join(f"{k}\0{v}\0".encode() for k, v in values.items()))
        return 0
    for key, value in values.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
