"""What `megarl-train --check` says once the preflight has passed: the memory plan
(megarl/launcher/memory_plan.py) and, on a machine without a GPU (a login node), what only the
nodes can check, one line each.

Exit codes of --check: 0 when every check that can run here passed (the "not checked here" lines,
if any, name what the job checks when it starts); 2 for a config or input error, a memory plan
that cannot fit the device included (one `megarl: config error:` line).
"""
from __future__ import annotations

import json
import os

from megarl.models.hf_config import find_hf_config
from megarl.launcher.memory_plan import memory_plan


def report(cfg, not_checked: list[str]) -> None:
    """Print the plan and the unchecked items; ConfigError when the plan cannot fit."""
    hf = find_hf_config(cfg.model.path) if cfg.model.path else None
    if hf is None:
        print("megarl: memory plan: once the bootstrap has built the model (no config.json yet)")
    else:
        plan = memory_plan(cfg, hf, _critic_config(cfg))
        print(plan.render())
        plan.check_fits()
    for line in not_checked:
        print(f"megarl: not checked here: {line}")


def _critic_config(cfg) -> dict | None:
    crit = cfg.critic
    if not (crit.enable and crit.model.init_from == "path" and crit.model.path):
        return None
    with open(os.path.join(crit.model.path, "config.json")) as f:   # the preflight has read it already
        return json.load(f)
