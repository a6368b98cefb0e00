"""Hostile pickles in every file a resume loads, on real checkpoints of the sync and async trainers.

A crafted file calls os.system("touch MARKER") when unpickled. The test first shows that such a
file is live for the readers underneath megarl (torch.load(weights_only=False), torch's
distributed-checkpoint metadata reader); then puts one in place of each file of a real step, in
turn, and resumes through megarl's own path: the marker is never written, and the one-line
refusal names the step and the file. End to end, `python -m megarl.train` refuses to resume
from a step with a hostile actor/.metadata, naming it.

With -s it prints the files tried and the markers written.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from megarl.config import ConfigError
from megarl.trainer.checkpoints import checkpointing, verified_io
from tests.faults.runs import overrides
from tests.helpers.hostile import write_hostile

STEP = 2


def train(args, timeout=600) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml", *args],
                         capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def runs(sync_reference, async_reference):
    """A real sync run and a real async run (the fault suite's reference runs, conftest.py), each
    saving global_step_2 and training on past it, so the async one's step 2 carries the in-flight batch."""
    return {"sync": sync_reference["dir"], "async": async_reference["dir"]}


def step_files(step_dir) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), step_dir) for d, _, fs in os.walk(step_dir) for f in fs)


def scratch_copy(run_dir, tmp_path, name="copy") -> str:
    """A copy of the run's step 2 under a private run directory of its own."""
    root = tmp_path / name
    root.mkdir(mode=0o700)
    dst = str(root / f"global_step_{STEP}")
    shutil.copytree(run_dir / f"global_step_{STEP}", dst)
    return dst


def resume_refused(step_dir, marker) -> str:
    """Resume through megarl's path (verification, roles, trainer state, RNG); the one-line error."""
    loaded = []

    class Role:                       # reached only if verification let the step through
        def load_checkpoint(self, path):
            from megarl.workers.checkpoint import read_meta
            loaded.append(read_meta(path))

    with pytest.raises(ConfigError) as err:
        checkpointing.load(step_dir, {"actor": Role()}, rank=0, world=1)
    assert not os.path.exists(marker), f"{marker} was written: hostile code ran"
    assert not loaded
    text = str(err.value)
    assert "\n" not in text and f"global_step_{STEP}" in text, text
    return text


def test_saved_steps_are_private_and_sealed(runs):
    for run_dir in runs.values():
        step_dir = run_dir / f"global_step_{STEP}"
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        listed = verified_io.json.load(open(step_dir / verified_io.MANIFEST))["sha256"]
        assert sorted(listed) == [f for f in step_files(step_dir) if f != verified_io.MANIFEST]
        assert {"trainer_state.pt", "rng/rank_0.pt", "actor/.metadata", "actor/common.pt"} <= set(listed)
        for d, dirs, files in os.walk(step_dir):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600, (d, f)
        verified_io.verify(str(step_dir))                           # untouched: accepted
        state = checkpointing.read_trainer_state(str(step_dir))
        assert state["step"] == STEP
    inflight = checkpointing.read_trainer_state(str(runs["async"] / f"global_step_{STEP}"))["inflight_batch"]
    assert inflight is not None and len(inflight) == 32 and "token_versions" in inflight.batch.keys()


def test_crafted_files_are_live_without_verification(runs, tmp_path):
    """The control: these files do run code for the readers megarl sits on."""
    from torch.distributed.checkpoint import FileSystemReader
    step_dir = scratch_copy(runs["sync"], tmp_path)
    for rel, read in (("trainer_state.pt", lambda p: torch.load(p, weights_only=False)),
                      ("actor/.metadata", lambda p: FileSystemReader(os.path.dirname(p)).read_metadata())):
        marker = str(tmp_path / f"marker-{rel.replace('/', '_')}")
        write_hostile(os.path.join(step_dir, rel), marker)
        try:
            read(os.path.join(step_dir, rel))
        except Exception:
            pass                      # what the pickle returns is not the real object; the code ran first
        assert os.path.exists(marker), rel


def test_a_hostile_pickle_in_every_file_is_refused_before_it_loads(runs, tmp_path):
    tried = 0
    for name, run_dir in runs.items():
        files = step_files(run_dir / f"global_step_{STEP}")
        for i, rel in enumerate(files):
            step_dir = scratch_copy(run_dir, tmp_path, f"{name}-{i}")
            marker = str(tmp_path / f"marker-{name}-{i}")
            write_hostile(os.path.join(step_dir, rel), marker)
            text = resume_refused(step_dir, marker)
            assert rel in text, (rel, text)
            if rel != verified_io.MANIFEST:
                assert re.search(r"differs from the SHA-256 digest|is truncated|bytes, not the", text), text
            tried += 1
            shutil.rmtree(os.path.dirname(step_dir))
    print(f"\nhostile pickles: {tried} files tried (sync + async steps), 0 markers written")
    assert tried >= 20


def test_plain_state_files_refuse_code_even_with_a_rewritten_manifest(runs, tmp_path):
    """Defence in depth: someone who can also rewrite manifest.json still cannot run code through
    trainer_state.pt or rng/*.pt (torch's weights-only unpickler refuses the call)."""
    for rel in ("trainer_state.pt", "rng/rank_0.pt"):
        step_dir = scratch_copy(runs["async"], tmp_path, rel.replace("/", "_"))
        marker = str(tmp_path / f"marker-{rel.replace('/', '_')}")
        write_hostile(os.path.join(step_dir, rel), marker)
        verified_io.seal(step_dir)                                  # the attacker re-seals the step
        world = checkpointing.read_trainer_state(str(runs["async"] / f"global_step_{STEP}"))["world"]
        with pytest.raises(ConfigError) as err:                     # as rank 0 of the saved world
            checkpointing.load(step_dir, {}, rank=0, world=world)
        assert not os.path.exists(marker)
        assert rel in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_files_that_others_could_have_written_are_refused(runs, tmp_path):
    cases = {
        "another owner": lambda d: os.chown(os.path.join(d, "actor/.metadata"), 65534, 65534),
        "group-writable": lambda d: os.chmod(os.path.join(d, "rng/rank_1.pt"), 0o620),
        "world-writable directory": lambda d: os.chmod(os.path.join(d, "actor"), 0o777),
        "a symbolic link": lambda d: (os.remove(os.path.join(d, "rng/rank_0.pt")),
                                      os.symlink("/etc/hostname", os.path.join(d, "rng/rank_0.pt"))),
        "an added file": lambda d: open(os.path.join(d, "actor", "extra.pt"), "wb").close(),
        "no manifest": lambda d: os.remove(os.path.join(d, verified_io.MANIFEST)),
        "a group-writable run directory": lambda d: os.chmod(os.path.dirname(d), 0o770),
    }
    expect = {"another owner": "actor/.metadata is owned by uid 65534",
              "group-writable": "rng/rank_1.pt is writable by group",
              "world-writable directory": "actor is writable by", "a symbolic link": "rng/rank_0.pt is a symbolic link",
              "an added file": "actor/extra.pt is not in the manifest", "no manifest": "manifest.json is missing",
              "a group-writable run directory": "is writable by group"}
    for i, (case, damage) in enumerate(cases.items()):
        step_dir = scratch_copy(runs["sync"], tmp_path, f"perm-{i}")
        damage(step_dir)
        text = resume_refused(step_dir, str(tmp_path / "never"))
        assert expect[case] in text, (case, text)


@pytest.mark.timeout(600)
def test_megarl_train_refuses_a_hostile_step_naming_the_file(runs, addition_model_dir, tmp_path):
    # The sync trainer's megatron metadata: the one file torch can only read by unpickling. (The
    # async trainer resumes through the same checkpointing.load, checked file by file above.)
    for name, rel, extra in (("sync", "actor/.metadata", ()),):
        run_dir = tmp_path / name
        shutil.copytree(runs[name], run_dir)
        latest = os.path.basename(checkpointing.latest_step_dir(str(run_dir)))   # what auto-resume picks
        marker = str(tmp_path / f"marker-{name}")
        write_hostile(str(run_dir / latest / rel), marker)
        rc, out = train(overrides(addition_model_dir, run_dir, int(latest.rsplit("_", 1)[1]) + 2, *extra))
        assert rc != 0 and not os.path.exists(marker), out[-3000:]
        # (How a rank's error reaches the console, torchrun's report included, is the launcher's.)
        assert re.search(rf"cannot resume from {latest}: {re.escape(rel)} (differs|has \d+ bytes|is truncated)", out), \
            out[-3000:]
        assert "resumed from" not in out
