"""megarl-train's command line and the config as every launch path checks it (megarl/train.py,
`python -m megarl.launcher.vars`, launcher/check.py): one parser, one set of checks.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

from megarl.experiment import ExperimentConfig, load_config, read_hf_config
from megarl.launcher.preflight import node_checks, preflight


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl-train",
                                     description="megarl-train: run an RL experiment from a YAML config.")
    parser.add_argument("--config", "-c", help="experiment YAML (may name a `base:`)")
    parser.add_argument("--print-config", action="store_true",
                        help="validate, print the resolved config and exit without starting anything")
    parser.add_argument("--check", action="store_true",
                        help="run every check a launch runs (files, model, lengths, engine, reward, run dir) and exit")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show every warning (megatron's notices about optional NVIDIA packages included)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.rollout.n=5")
    return parser.parse_intermixed_args(argv)   # overrides may come before or after the flags


# Set by launch/*: the launcher ran preflight() once for the job before starting any rank.
PREFLIGHT_DONE_ENV = "MEGARL_PREFLIGHT_DONE"


def load_checked(config: str | None, overrides: list[str], check_all: bool = True,
                 not_checked: list[str] | None = None,
                 loaded: Callable[[ExperimentConfig], None] | None = None) -> ExperimentConfig:
    """The config, validated; with `check_all`, also everything megarl.launcher.preflight can check
    (files, model, lengths, engine, reward, run directory) before any process starts. A rank whose
    launcher already did that checks only its own node (preflight.node_checks). `not_checked`
    (--check): where what needs the nodes' GPUs is listed on a machine without one. `loaded` is
    called with the valid config before those checks (megarl-train starts torchrun's agent there)."""
    cfg = load_config(config, overrides)
    if loaded is not None:
        loaded(cfg)
    if check_all and os.environ.get(PREFLIGHT_DONE_ENV) == "1" and "RANK" in os.environ:
        node_checks(cfg)
    elif check_all:
        preflight(cfg, not_checked)
    elif cfg.model.path:
        hf = read_hf_config(cfg.model.path)
        if hf is not None:
            cfg.check_model(hf)
    return cfg
