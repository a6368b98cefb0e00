"""`megarl-train --check` creates nothing: the run directory, the generation dumps and the log
directory are checked creatable (nearest existing parent a writable directory, the owner rules where
they exist) and made by the run only. One spawn of `--check`; the rest through the real preflight.

    python -m pytest -q tests/test_check_creates_nothing.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.launcher.preflight import preflight

QUICKSTART = "configs/quickstart.yaml"


@pytest.fixture
def base(tmp_path, addition_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "addition",
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(40)))
    return [f"actor_rollout_ref.model.path={addition_model_dir}", f"data.train_files={data}", "data.val_files=[]"]


def outputs(root) -> list[str]:
    return [f"trainer.default_local_dir={root / 'rl' / 'checkpoints' / 'run'}",
            f"trainer.rollout_data_dir={root / 'dumps' / 'rollout'}",
            f"trainer.validation_data_dir={root / 'dumps' / 'val'}", f"trainer.log_dir={root / 'logs'}"]


def test_check_leaves_a_missing_output_tree_absent(base, tmp_path):
    root = tmp_path / "absent"
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", QUICKSTART, "--check", *base,
                          *outputs(root)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "nothing was started" in out.stdout, out.stdout
    assert not root.exists(), sorted(str(p) for p in root.rglob("*"))


def test_an_output_under_a_file_is_refused_without_making_anything(base, tmp_path):
    (tmp_path / "a_file").write_text("")
    run = tmp_path / "a_file" / "run"
    with pytest.raises(ConfigError, match=rf"^trainer.default_local_dir: cannot write to {run} \(Not a directory\)"):
        preflight(load_config(QUICKSTART, [*base, f"trainer.default_local_dir={run}"]))
    dumps = tmp_path / "fresh" / "dumps"
    with pytest.raises(ConfigError, match=r"^trainer.rollout_data_dir: cannot create or write .*a_file/d "
                                          r"\(Not a directory\)"):
        preflight(load_config(QUICKSTART, [*base, f"trainer.default_local_dir={tmp_path / 'fresh' / 'run'}",
                                           f"trainer.validation_data_dir={dumps}",
                                           f"trainer.rollout_data_dir={tmp_path / 'a_file' / 'd'}"]))
    assert not (tmp_path / "fresh").exists()


def test_existing_outputs_keep_the_owner_rules(base, tmp_path):
    """An existing run or dump directory others can write is still refused; one of this user's passes."""
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    run.mkdir(mode=0o700)
    dumps.mkdir()
    os.chmod(dumps, 0o777)
    overrides = [*base, f"trainer.default_local_dir={run}", f"trainer.rollout_data_dir={dumps}"]
    with pytest.raises(ConfigError, match=r"^trainer.rollout_data_dir: .*dumps is writable by group and others"):
        preflight(load_config(QUICKSTART, overrides))
    os.chmod(dumps, 0o700)
    os.chmod(run, 0o770)
    with pytest.raises(ConfigError, match=r"^trainer.default_local_dir: .*run is writable by group"):
        preflight(load_config(QUICKSTART, overrides))
    os.chmod(run, 0o700)
    preflight(load_config(QUICKSTART, overrides))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode")
def test_a_missing_run_directory_under_a_read_only_parent(base, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"cannot write to .*locked/run \(Permission denied\)"):
        preflight(load_config(QUICKSTART, [*base, f"trainer.default_local_dir={locked / 'run'}"]))
