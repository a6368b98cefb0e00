"""What a run writes and shows is its user's alone: a token read with `${oc.env:...}` never reaches
run/config.yaml, --print-config or wandb's config (each says `<from env NAME>`), and under `umask 000`
with a run directory made beforehand at 0755 every file and folder of the run is private. One real
run (megarl-train, 2 ranks, two steps: conftest.py's scored_run) checks the run directory; the config
paths run in this process.

    python -m pytest -q tests/faults/test_private_outputs.py
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import types

import pytest

from megarl.experiment import load_config
from tests.faults.conftest import ENV, TOKEN, WITH_TOKEN


def test_print_config_shows_where_a_value_came_from_not_the_value():
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml",
                          "--print-config", *WITH_TOKEN], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr
    assert TOKEN not in out.stdout + out.stderr
    assert "  project_name: <from env MEGARL_TEST_TOKEN>" in out.stdout.splitlines()
    assert "  experiment_name: exp-<from env MEGARL_TEST_TOKEN>-1" in out.stdout.splitlines()
    # a key built from one that came from the environment hides it too
    assert "  default_local_dir: runs/<from env MEGARL_TEST_TOKEN>/exp-<from env MEGARL_TEST_TOKEN>-1" \
        in out.stdout.splitlines()


def test_wandb_gets_the_config_without_the_value(monkeypatch, tmp_path):
    # wandb is not installed here: a stand-in with wandb.init's keywords records what it is given.
    got = {}

    def init(*, project, name, config, dir, id, resume):
        got.update(project=project, name=name, config=config)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    util = types.SimpleNamespace(generate_id=lambda: "x1")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, util=util))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    cfg = load_config("configs/quickstart.yaml", WITH_TOKEN)
    assert cfg.trainer.project_name == TOKEN                 # the run itself reads the value
    from megarl.trainer.metrics.logger import MetricsLogger
    MetricsLogger(str(tmp_path), ["wandb"], "p", "e", config=cfg.to_dict())
    assert got["config"]["trainer"]["project_name"] == "<from env MEGARL_TEST_TOKEN>"
    assert TOKEN not in repr(got["config"])


@pytest.mark.timeout(900)
def test_a_run_under_umask_000_in_a_0755_directory_keeps_everything_private(scored_run):
    run_dir, rc, out = scored_run["dir"], scored_run["rc"], scored_run["out"]
    assert rc == 0, out[-3000:]
    assert f"megarl: {run_dir} was readable by other users (mode 755); made it 0700" in out, out[-3000:]
    assert TOKEN not in out
    open_to_others = []
    for root, dirs, files in os.walk(run_dir):
        for name in [*dirs, *files]:
            path = os.path.join(root, name)
            if stat.S_IMODE(os.lstat(path).st_mode) & 0o077:
                open_to_others.append(f"{os.path.relpath(path, run_dir)} {stat.S_IMODE(os.lstat(path).st_mode):o}")
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert not open_to_others, open_to_others
    written = {"config.yaml", "command.json", "metrics.jsonl", "logs"}
    assert written <= set(os.listdir(run_dir)), os.listdir(run_dir)
    config = (run_dir / "config.yaml").read_text()
    assert TOKEN not in config and "project_name: <from env MEGARL_TEST_TOKEN>" in config
    for root, _, files in os.walk(run_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert TOKEN.encode() not in f.read(), os.path.join(root, name)


@pytest.mark.parametrize("mode, words", [(0o755, "readable"), (0o775, "writable"), (0o705, "readable"),
                                         (0o700, None)])
def test_a_run_directory_open_to_others_is_made_0700_in_one_line(tmp_path, mode, words):
    from megarl.launcher.preflight_run import tighten_run_dir
    os.chmod(tmp_path, mode)
    note = tighten_run_dir(str(tmp_path))
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    if words is None:
        assert note is None
    else:
        assert note == (f"megarl: {tmp_path} was {words} by other users (mode {mode:o}); made it 0700, as megarl "
                        "keeps a run's files to its user")
