"""Write megarl/config/verl_defaults.yaml: verl's default of every verl key megarl does not implement.

    python tests/assets/verl/make_defaults.py      (from the repository root)

Input: config/_generated_ppo_trainer.yaml and config/_generated_ppo_megatron_trainer.yaml here,
verl's own Hydra composition of ppo_trainer.yaml / ppo_megatron_trainer.yaml and every file their
defaults lists include (all stored under config/), copied unchanged from verl v0.7.0
(commit f9c855f7cf04d603c9546bc01776c74806a879c1, Apache-2.0, see LICENSE).
"""
from __future__ import annotations

import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")


def verl_leaves() -> dict[str, list]:
    """dotted key -> distinct defaults across the two composed trees (an empty mapping is a leaf)."""
    out: dict[str, list] = {}

    def walk(node, prefix):
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(value, dict) and value:
                walk(value, key)
            elif value not in out.setdefault(key, []):
                out[key].append(value)

    for tree in TREES:
        with open(os.path.join(HERE, "config", tree)) as f:
            walk(yaml.safe_load(f), "")
    return out


def table() -> dict:
    from megarl.config.experiment import ExperimentConfig
    from megarl.config.verl_keys import VERL_RELEASE, megarl_implements
    keys = {k: v for k, v in verl_leaves().items() if not megarl_implements(k, ExperimentConfig)}
    return {"release": VERL_RELEASE, "keys": keys}


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from megarl.config.verl_keys import DEFAULTS_FILE
    with open(DEFAULTS_FILE, "w") as f:
        f.write("# verl's default of each verl key megarl does not implement (megarl/config/verl_keys.py).\n"
                "# Written by tests/assets/verl/make_defaults.py from verl's composed trainer configs.\n")
        yaml.safe_dump(table(), f, sort_keys=True, default_flow_style=False)
    print(f"wrote {DEFAULTS_FILE}")
