"""Write megarl/config/verl_defaults.yaml: verl's default of every verl key megarl does not implement.

    pip install --no-deps verl==0.9.1
    python tests/assets/verl/make_defaults.py      (from the repository root)

Input: two releases of verl's own Hydra composition of ppo_trainer.yaml / ppo_megatron_trainer.yaml
(_generated_ppo_trainer.yaml, _generated_ppo_megatron_trainer.yaml; 0.9.1 also ships its torchtitan and
VeOmni engines' trees, _generated_ppo_{torchtitan,veomni}_trainer.yaml, walked too):
- v0.7.0: stored under config/ here with every file their defaults lists include, copied unchanged
  from verl v0.7.0 (commit f9c855f7cf04d603c9546bc01776c74806a879c1, Apache-2.0, see LICENSE);
- 0.9.1: read from the installed verl package (verl/trainer/config/), which ships them. verl's
  __init__ needs tensordict and ray, so the package is located without being imported.
A key in both releases is accepted at either release's default.
"""
from __future__ import annotations

import importlib.metadata
import importlib.machinery
import importlib.util
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")
# 0.9.1 also composes its torchtitan and VeOmni engines (model_engine=torchtitan / veomni)
ENGINE_TREES = {"0.7.0": (), "0.9.1": ("_generated_ppo_torchtitan_trainer.yaml", "_generated_ppo_veomni_trainer.yaml")}
RELEASES = ("0.7.0", "0.9.1")
INSTALL = "pip install --no-deps verl==0.9.1"


def installed_verl() -> str | None:
    """verl/trainer/config of the installed verl 0.9.1, or None where verl is not installed.
    Another installed release is an error: its trees would silently replace 0.9.1's."""
    # PathFinder searches sys.path only: a test may have left a stand-in `verl` in sys.modules.
    spec = importlib.machinery.PathFinder.find_spec("verl")
    if spec is None or spec.origin is None:
        return None
    version = importlib.metadata.version("verl")
    if version != "0.9.1":
        raise RuntimeError(f"installed verl is {version}; the key-tree oracle is verl 0.9.1: {INSTALL}")
    return os.path.join(os.path.dirname(spec.origin), "trainer", "config")


def tree_dir(release: str) -> str:
    if release == "0.7.0":
        return os.path.join(HERE, "config")
    found = installed_verl()
    if found is None:
        raise FileNotFoundError(f"verl {release}'s trees come from the installed package: {INSTALL}")
    return found


def _walk_trees(release: str, trees: tuple[str, ...]) -> dict[str, list]:
    out: dict[str, list] = {}

    def walk(node, prefix):
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(value, dict) and value:
                walk(value, key)
            elif value not in out.setdefault(key, []):
                out[key].append(value)

    for tree in trees:
        with open(os.path.join(tree_dir(release), tree)) as f:
            walk(yaml.safe_load(f), "")
    return out


def verl_leaves(release: str = "0.7.0") -> dict[str, list]:
    """dotted key -> distinct defaults across one release's composed trees (an empty mapping is a leaf).
    A leaf the torchtitan / VeOmni trees add comes with their defaults; a leaf the FSDP and megatron
    trees hold keeps theirs only (strategy=torchtitan asks for another engine: engine_only_values)."""
    out = _walk_trees(release, TREES)
    for key, values in _walk_trees(release, ENGINE_TREES[release]).items():
        out.setdefault(key, values)
    return out


def engine_only_values(release: str = "0.9.1") -> dict[str, list]:
    """key -> the defaults only the torchtitan / VeOmni trees give a leaf the other trees hold too."""
    main, engines = _walk_trees(release, TREES), _walk_trees(release, ENGINE_TREES[release])
    out = {k: [v for v in values if v not in main[k]] for k, values in engines.items() if k in main}
    return {k: v for k, v in out.items() if v}


def all_leaves() -> dict[str, list]:
    """Both releases' leaves, each key with the defaults of every release that has it."""
    out: dict[str, list] = {}
    for release in RELEASES:
        for key, defaults in verl_leaves(release).items():
            out.setdefault(key, []).extend(d for d in defaults if d not in out[key])
    return out


def table() -> dict:
    from megarl.experiment import ExperimentConfig
    from megarl.config.verl_keys import VERL_RELEASE, megarl_implements
    from megarl.config.refused import moved_from
    keys = {k: v for k, v in all_leaves().items()
            if not megarl_implements(k, ExperimentConfig) and not moved_from(k)}
    return {"release": VERL_RELEASE, "keys": keys}


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from megarl.config.verl_keys import DEFAULTS_FILE
    with open(DEFAULTS_FILE, "w") as f:
        f.write("# verl's default of each verl key megarl does not implement (megarl/config/verl_keys.py).\n"
                "# Written by tests/assets/verl/make_defaults.py from verl's composed trainer configs.\n")
        yaml.safe_dump(table(), f, sort_keys=True, default_flow_style=False)
    print(f"wrote {DEFAULTS_FILE}")
