"""A checkpoint file megarl reads is hashed and loaded from the same bytes, read once through one
descriptor: a file swapped after verify() checked the step (the window a resume used to leave open,
24-340 ms on a loaded machine) is refused, never loaded. In-process, on a step sealed here (~1 s).
"""
from __future__ import annotations

import os

import pytest
import torch

from megarl.config import ConfigError
from megarl.trainer import checkpointing, verified_io


def sealed_step(tmp_path):
    step = tmp_path / "global_step_2"
    verified_io.make_private_dir(str(tmp_path))
    verified_io.make_private_dir(str(step))
    verified_io.make_private_dir(str(step / "rng"))
    verified_io.save_plain({"step": 2, "bad_steps": 0}, str(step / "trainer_state.pt"))
    verified_io.save_plain({"torch": torch.tensor([1, 2, 3])}, str(step / "rng" / "rank_0.pt"))
    verified_io.seal(str(step))
    return str(step)


def test_a_file_swapped_after_the_check_is_refused_at_its_load(tmp_path):
    step = sealed_step(tmp_path)
    verified_io.verify(step)
    assert verified_io.load_sealed(step, "trainer_state.pt") == {"step": 2, "bad_steps": 0}
    assert checkpointing.read_trainer_state(step)["step"] == 2          # what a resume calls
    assert verified_io.load_sealed(step, "rng/rank_0.pt")["torch"].tolist() == [1, 2, 3]
    # after verify() accepted the step, another valid file takes trainer_state.pt's place
    swapped = tmp_path / "other.pt"
    verified_io.save_plain({"step": 9, "bad_steps": 0}, str(swapped))
    os.replace(swapped, os.path.join(step, "trainer_state.pt"))
    with pytest.raises(verified_io.Refused, match="trainer_state.pt differs from the SHA-256 digest"):
        verified_io.load_sealed(step, "trainer_state.pt")
    with pytest.raises(ConfigError, match="trainer_state.pt") as err:      # a resume's one line
        checkpointing.read_trainer_state(step)
    assert "\n" not in str(err.value)
    # a link put in its place is not followed
    os.remove(os.path.join(step, "rng", "rank_0.pt"))
    os.symlink(os.path.join(step, "trainer_state.pt"), os.path.join(step, "rng", "rank_0.pt"))
    with pytest.raises(OSError):
        verified_io.load_sealed(step, "rng/rank_0.pt")
