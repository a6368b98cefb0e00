"""One wandb run across resumes: the run's wandb id is made once, kept in the run directory and
given to wandb.init on every start, so a resumed run continues the same wandb run.

wandb is not installed here, so a stand-in takes its place: wandb.init's keywords and the run-id
rule as wandb declares them (wandb/wandb@b6e29505884ea60c79ca12091f1f75bd39d2f955:
wandb/sdk/wandb_init.py `init`, wandb/sdk/wandb_settings.py `validate_run_id`), refusing what
wandb refuses, and a `wandb.util` without `generate_id`, as wandb 0.31.0 (PyPI) ships it. Where
wandb is installed, the last test runs the real one offline across a resume. The rest of the
metrics path needs no wandb at all.
"""
from __future__ import annotations

import os
import sys
import types

import pytest

from megarl.trainer.metrics.logger import WANDB_ID_FILE, MetricsLogger

_RESUME = (None, True, False, "allow", "never", "must", "auto")


class StrictWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls: list[dict] = []
        self.util = types.SimpleNamespace()          # wandb 0.31.0's wandb.util has no generate_id

    def init(self, entity=None, project=None, dir=None, id=None, name=None, notes=None, tags=None, config=None,
             config_exclude_keys=None, config_include_keys=None, allow_val_change=None, group=None, job_type=None,
             mode=None, force=None, reinit=None, resume=None, resume_from=None, fork_from=None, save_code=None,
             tensorboard=None, sync_tensorboard=None, monitor_gym=None, settings=None):
        if resume not in _RESUME:
            raise ValueError(f"resume={resume!r}")
        if id is not None:
            if not id.strip() or id != id.strip():
                raise ValueError("Run ID cannot be empty or start or end with whitespace")
            if any(c in ":;,#?/'" for c in id):
                raise ValueError("Run ID cannot contain the characters: :;,#?/'")
        self.calls.append(dict(project=project, name=name, dir=dir, id=id, resume=resume))
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.fixture
def wandb(monkeypatch):
    fake = StrictWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return fake


def test_a_resume_continues_the_same_wandb_run(wandb, tmp_path):
    run, other = str(tmp_path / "run"), str(tmp_path / "other")
    MetricsLogger(run, ["console", "wandb"], "p", "e").close()
    first = wandb.calls[-1]
    assert first["resume"] == "allow" and first["id"] and first["dir"] == run
    with open(os.path.join(run, WANDB_ID_FILE)) as f:
        assert f.read().strip() == first["id"]
    assert os.stat(os.path.join(run, WANDB_ID_FILE)).st_mode & 0o077 == 0
    MetricsLogger(run, ["console", "wandb"], "p", "e").close()        # the resume: same directory, same run
    assert wandb.calls[-1]["id"] == first["id"]
    MetricsLogger(other, ["wandb"], "p", "e").close()                 # another run directory: another run
    assert wandb.calls[-1]["id"] != first["id"]


def test_the_users_run_id_wins_and_a_bad_kept_one_is_one_line(wandb, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("WANDB_RUN_ID", "mine42")
    MetricsLogger(str(run), ["wandb"], "p", "e").close()
    assert wandb.calls[-1]["id"] == "mine42" and not (run / WANDB_ID_FILE).exists()
    monkeypatch.delenv("WANDB_RUN_ID")
    (run / WANDB_ID_FILE).write_text("a/b\n")
    with pytest.raises(RuntimeError, match=f"{run / WANDB_ID_FILE} holds 'a/b', not a wandb run id") as err:
        MetricsLogger(str(run), ["wandb"], "p", "e")
    assert "\n" not in str(err.value) and not wandb.calls[1:]


def test_metrics_need_no_wandb_unless_asked(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)        # `import wandb` raises ImportError
    log = MetricsLogger(str(tmp_path), ["console"], "p", "e")
    log.log(1, {"critic/score/mean": 0.5})
    log.close()
    assert not (tmp_path / WANDB_ID_FILE).exists()
    with pytest.raises(RuntimeError, match="trainer.logger includes wandb but the package is missing"):
        MetricsLogger(str(tmp_path), ["wandb"], "p", "e")


def test_real_wandb_offline_keeps_one_run_across_a_resume(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    run = str(tmp_path / "run")
    for step in (1, 2):                               # the first start, then the resume
        log = MetricsLogger(run, ["wandb"], "p", "e")
        log.log(step, {"critic/score/mean": 0.5})
        log.close()
    kept = open(os.path.join(run, WANDB_ID_FILE)).read().strip()
    runs = [d for d in os.listdir(os.path.join(run, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 2 and all(d.endswith(f"-{kept}") for d in runs), (wandb.__version__, runs)
