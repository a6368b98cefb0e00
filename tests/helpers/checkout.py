"""Tests see a fresh clone, whatever the checkout holds.

The README's first command bootstraps the quickstart's model into runs/models/ and leaves a run in
runs/megarl/quickstart/; a config's relative paths (`../runs/models/...`, the default run directory)
would lead a test there. These helpers point such paths into the test's own temporary directory.
"""
from __future__ import annotations

import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_copy(tmp_path, name: str = "quickstart.yaml") -> str:
    """configs/ copied under tmp_path beside links to data/ and megarl/: `name` as written, whose
    ../runs/models/ bootstrap path lies in tmp_path (empty), not in the checkout."""
    root = os.path.join(str(tmp_path), "checkout")
    if not os.path.isdir(root):
        os.makedirs(root)
        shutil.copytree(os.path.join(ROOT, "configs"), os.path.join(root, "configs"))
        for tracked in ("data", "megarl"):         # what configs name beside runs/ (read only: tracked files)
            os.symlink(os.path.join(ROOT, tracked), os.path.join(root, tracked))
    return os.path.join(root, "configs", name)


def unbuilt_model(tmp_path, bootstrap: str = "megarl.examples.addition:bootstrap") -> list[str]:
    """Overrides that give the quickstart's bootstrap a path under tmp_path that does not exist yet:
    the state of a fresh clone (its preflight cannot tokenize before the bootstrap builds the model)."""
    path = os.path.join(str(tmp_path), "unbuilt-model")
    return [f"actor_rollout_ref.model.bootstrap={bootstrap}", f"actor_rollout_ref.model.path={path}"]
