"""A hub id as model.path (verl's habit) whose snapshot is in HF_HOME's cache is read from there,
with nothing downloaded; one that is not is one line naming `hf download`, the CLI huggingface_hub
ships. The cache is laid out by huggingface_hub's own rules (its folder name for the repo, refs/main,
snapshots/<commit> linking into blobs/) and checked by its own scanner before megarl reads it.

    python -m pytest -q tests/test_hub_cache.py
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "megarl-test/addition"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# In a fresh interpreter: huggingface_hub reads HF_HOME when it is imported.
LOAD = """
import json, sys
from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.launcher.preflight import check_model_paths
try:
    config, overrides = (sys.argv[2], []) if len(sys.argv) > 2 else \
        ("configs/quickstart.yaml", ["actor_rollout_ref.model.path=" + sys.argv[1]])
    cfg = load_config(config, overrides)
    check_model_paths(cfg)
    print(json.dumps({"path": cfg.model.path}))
except ConfigError as err:
    print(json.dumps({"error": str(err)}))
"""


def cache_model(hub_cache: str, model_dir: str) -> str:
    """`model_dir`'s files in the cache as a download leaves them; returns the snapshot directory."""
    repo = os.path.join(hub_cache, repo_folder_name(repo_id=REPO, repo_type="model"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(snapshot)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name in sorted(os.listdir(model_dir)):
        with open(os.path.join(model_dir, name), "rb") as f:
            blob = hashlib.sha256(f.read()).hexdigest()
        shutil.copy(os.path.join(model_dir, name), os.path.join(repo, "blobs", blob))
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    return snapshot


def load(hf_home: str, model_path: str, config: str | None = None, **extra_env: str) -> dict:
    env = {**os.environ, "HF_HOME": hf_home, "HF_ENDPOINT": "http://127.0.0.1:9", **extra_env}  # no hub to reach
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        env.pop(name, None)
    args = [sys.executable, "-c", LOAD, model_path, *([config] if config else [])]
    got = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_a_hub_id_in_the_cache_is_read_from_its_snapshot(tmp_path, addition_model_dir):
    hf_home = tmp_path / "hf"
    snapshot = cache_model(str(hf_home / "hub"), addition_model_dir)
    seen = scan_cache_dir(hf_home / "hub")                  # huggingface_hub recognises the layout
    assert [(r.repo_id, [v.commit_hash for v in r.revisions]) for r in seen.repos] == [(REPO, [COMMIT])]
    assert load(str(hf_home), REPO) == {"path": snapshot}    # and megarl's checks pass on it, offline


def test_a_hub_id_behind_an_environment_default_is_read_from_the_cache(tmp_path, addition_model_dir):
    """The shipped 7B configs write `path: ${env:MODEL,Qwen/Qwen2.5-7B-Instruct}`: the hub id, as the
    default or as MODEL's value, comes from the cache as a written-out one does."""
    hf_home = tmp_path / "hf"
    snapshot = cache_model(str(hf_home / "hub"), addition_model_dir)
    config = tmp_path / "conf" / "grpo.yaml"
    config.parent.mkdir()
    config.write_text(f"base: {ROOT}/configs/quickstart.yaml\n"
                      f"actor_rollout_ref: {{model: {{path: '${{env:MEGARL_TEST_MODEL,{REPO}}}'}}}}\n")
    assert load(str(hf_home), "", str(config)) == {"path": snapshot}
    config.write_text(f"base: {ROOT}/configs/quickstart.yaml\n"
                      "actor_rollout_ref: {model: {path: '${env:MEGARL_TEST_MODEL,org/other}'}}\n")
    assert load(str(hf_home), "", str(config), MEGARL_TEST_MODEL=REPO) == {"path": snapshot}


def test_a_hub_id_not_in_the_cache_names_hf_download(tmp_path):
    got = load(str(tmp_path / "hf"), "megarl-test/absent")["error"]
    assert "\n" not in got and got.startswith("actor_rollout_ref.model.path: megarl-test/absent does not exist here "
                                              f"and is not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'})")
    assert "`hf download megarl-test/absent`" in got
    assert "`hf download megarl-test/absent --local-dir models/absent`" in got
