"""Runs shared by the fault suite's files (each launch costs ~10-20 s on 2 cores).

`sync_reference` / `async_reference`: an uninterrupted run of STEPS steps.
`sync_chain` / `async_chain`: that reference run, and one run directory taken through
a SIGKILL of the whole run at each kill point (a step, a save, a weight sync; the fault hook parks
rank 0 there, megarl/trainer/control/faults.py; the sync chain also between a step's checkpoint and its
metrics record), a torn last line in metrics.jsonl, and a final resume. The sync chain's run starts
with a SIGTERM to its first launch once it has started (it saves step 1, not a save_freq step, and
exits 143, tests/faults/test_stop_signal.py), so its first kill is also the resume of that stop.
The async chain's first kill parks a rollout rank instead (the second of two), inside its stream:
batch 4 finished in the buffer, batch 5's responses one chunk long (async_overrides: max_staleness
2, chunks of 1).
`scored_run`: two steps under umask 000, a token in the config, a reward that is NaN on a quarter of
the samples and prints megarl's words (read by the privacy, NaN-reward and console-forgery tests).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from megarl.experiment import load_config
from megarl.launcher.vars import stop_margin_lines
from megarl.trainer.metrics.logger import read_metrics
from tests.faults.runs import Launch, async_overrides, lock_is_free, overrides
from tests.helpers.training_runs import stable, step_digests

STEPS = 5
# (fault point, the checkpoint the next launch resumes from)
# `record`: step 4's checkpoint complete, its metrics record not yet written; the resume writes it.
KILL_POINTS = [("pause@step:3", 2), ("pause@save:4", 2), ("pause@record:4", 4), ("pause@sync:5", 4)]
ASYNC_KILL_POINTS = [("pause@stream:5:2", 2), ("pause@save:4", 2), ("pause@sync:5", 4)]
TORN = '{"step": 5, "critic/score/mean": 0.5, "actor/pg_l'


def _reference(model_dir, root, make_args) -> dict:
    ref_dir = root / "reference"
    rc, out = Launch(make_args(model_dir, ref_dir, STEPS)).finish()
    assert rc == 0, out[-3000:]
    return {"dir": ref_dir, "out": out}


def _stop(model_dir, run_dir, make_args) -> dict:
    """A fresh launch sent SIGTERM (the launcher only, as `kill <pid>` does) once it has started (its
    command.json, written after the resume and before step 1), so the stop's own save is step 1's;
    with what the next start (launch/slurm/job.sh) prints about the last save."""
    launch = Launch(make_args(model_dir, run_dir, STEPS))
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "command.json").is_file():
            assert launch.proc.poll() is None, launch.finish()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        launch.proc.send_signal(signal.SIGTERM)
        rc, out = launch.finish(timeout=300)
    finally:
        if launch.proc.poll() is None:
            launch.kill_group()
    pointer = run_dir / "latest_checkpointed_iteration.txt"
    cfg = load_config("configs/quickstart.yaml", make_args(model_dir, run_dir, STEPS))
    return {"rc": rc, "out": out, "left": launch.left_after(10),
            "pointer": pointer.read_text().strip() if pointer.is_file() else None,
            "records": read_metrics(str(run_dir)), "next_start": stop_margin_lines(cfg, 600)}


def _chain(model_dir, root, make_args, reference, kill_points=KILL_POINTS, stop_first=False) -> dict:
    run_dir = root / "killed"
    stop = _stop(model_dir, run_dir, make_args) if stop_first else None
    kills = []
    for fault, resumes_from in kill_points:
        launch = Launch(make_args(model_dir, run_dir, STEPS), fault=fault)
        launch.wait_paused()
        reached = open(launch.marker).read().strip()
        # A rollout rank parked in its stream leaves the trainer free to finish the save before it.
        pointer, deadline = run_dir / "latest_checkpointed_iteration.txt", time.monotonic() + 120
        while not (pointer.is_file() and pointer.read_text().strip() == str(resumes_from)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        launch.kill_group()
        kills.append({"fault": fault, "reached": reached, "out": launch.out, "left": launch.left_after(10),
                      "lock_free": lock_is_free(run_dir), "resumes_from": resumes_from,
                      "pointer": (run_dir / "latest_checkpointed_iteration.txt").read_text().strip(),
                      "dirs": sorted(os.listdir(run_dir)),
                      "logged": sorted({r["step"] for r in read_metrics(str(run_dir))})})
    with open(run_dir / "metrics.jsonl", "a") as f:   # a kill in the middle of a metrics write
        f.write(TORN)
    rc, final_out = Launch(make_args(model_dir, run_dir, STEPS)).finish()
    return {"ref": reference["dir"], "run": run_dir, "ref_out": reference["out"], "kills": kills, "rc": rc,
            "out": final_out, "stop": stop}


def check_same_as_reference(chain) -> dict:
    """Every step's metrics and, after the last step, the weights and optimizer state byte for
    byte, as the run never killed; returns its metrics by step."""
    ref = {r["step"]: r for r in read_metrics(str(chain["ref"]))}
    got = {r["step"]: r for r in read_metrics(str(chain["run"]))}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert stable(got[step]) == stable(ref[step]), step
    last = f"global_step_{STEPS}"
    assert step_digests(chain["run"] / last) == step_digests(chain["ref"] / last)
    return ref


# The sync chain's tests allow 1200 s: its six launches are built in the setup of the first of them.
# The uninterrupted runs, trained once and only read by every test that compares with or copies
# them (the chains below, the stop signal, damaged and hostile checkpoints): saves at steps 2, 4, 5.
@pytest.fixture(scope="session")
def sync_reference(addition_model_dir, tmp_path_factory):
    return _reference(addition_model_dir, tmp_path_factory.mktemp("sync_reference"), overrides)


@pytest.fixture(scope="session")
def async_reference(addition_model_dir, tmp_path_factory):
    return _reference(addition_model_dir, tmp_path_factory.mktemp("async_reference"), async_overrides)


@pytest.fixture(scope="session")
def sync_chain(addition_model_dir, sync_reference, tmp_path_factory):
    return _chain(addition_model_dir, tmp_path_factory.mktemp("sync_chain"), overrides, sync_reference,
                  stop_first=True)


@pytest.fixture(scope="session")
def async_chain(addition_model_dir, async_reference, tmp_path_factory):
    return _chain(addition_model_dir, tmp_path_factory.mktemp("async_chain"), async_overrides, async_reference,
                  ASYNC_KILL_POINTS)


# One 2-step run read by three files' tests: launched under umask 000 into a run directory made at
# 0755, with a token from the environment in its config (test_private_outputs.py), and scored by a
# reward that is NaN on a quarter of the samples (test_reward_faults.py) and prints megarl's own
# words while it scores (test_console_forgery.py).
TOKEN = "sk-live-0123456789abcdef"
ENV = {"MEGARL_TEST_TOKEN": TOKEN}
WITH_TOKEN = ["trainer.project_name=${oc.env:MEGARL_TEST_TOKEN}",
              "trainer.experiment_name=exp-${env:MEGARL_TEST_TOKEN}-1"]
FORGED = ["megarl: config error: data.train_files: this row says so", "megarl: stopped by SIGTERM after step 1",
          "megarl: stopped: rank 0: ran out of memory during gen (a row's text)"]
NATIVE = "memory allocation of 48 bytes failed"
SCORED_REWARD = '''
import sys
def score(data_source, solution_str, ground_truth, extra_info=None):
    for line in {lines!r}:
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
    if int(ground_truth) % 4 == 0:
        return float("nan")
    return float(solution_str.strip() == str(ground_truth).strip())
'''


@pytest.fixture(scope="session")
def scored_run(addition_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scored_run")
    reward, run_dir = root / "reward.py", root / "run"
    reward.write_text(SCORED_REWARD.format(lines=[*FORGED, NATIVE]))
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    old = os.umask(0)                  # the launch inherits it, as from a shell with `umask 000`
    try:
        launch = Launch(overrides(addition_model_dir, run_dir, 2, *WITH_TOKEN, "trainer.save_freq=1",
                                  f"custom_reward_function.path={reward}", "custom_reward_function.name=score"),
                        env=ENV)
    finally:
        os.umask(old)
    rc, out = launch.finish()
    return {"dir": run_dir, "rc": rc, "out": out}
