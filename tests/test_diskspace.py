"""The preflight's free-space need for the next checkpoint (megarl/launcher/diskspace.py): the bytes
the newest step's own manifest lists, else 14 bytes per parameter the safetensors headers declare
per trained role; nothing for a resume's read, which reads the step in place."""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from megarl.launcher import diskspace
from megarl.trainer.checkpoints import verified_io


def cfg(run_dir, model_dir, critic=False, save_freq=2):
    return SimpleNamespace(trainer=SimpleNamespace(save_freq=save_freq, default_local_dir=str(run_dir)),
                           critic=SimpleNamespace(enable=critic), model=SimpleNamespace(path=str(model_dir)))


def bf16_model(path, rows=1000, cols=64):
    os.makedirs(path)
    save_file({"model.embed_tokens.weight": torch.zeros(rows, cols, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(cols, dtype=torch.bfloat16)}, os.path.join(path, "model.safetensors"))
    return rows * cols + cols


def test_a_fresh_run_needs_14_bytes_a_parameter_per_trained_role(tmp_path):
    params = bf16_model(tmp_path / "model")
    assert diskspace.parameter_count(str(tmp_path / "model")) == params
    # bf16 safetensors hold 2 bytes a parameter: the checkpoint is 7x that, not 4x
    assert diskspace.checkpoint_need(cfg(tmp_path / "run", tmp_path / "model")) == 14 * params + diskspace.MARGIN
    assert diskspace.checkpoint_need(cfg(tmp_path / "run", tmp_path / "model", critic=True)) == \
        2 * 14 * params + diskspace.MARGIN
    assert diskspace.checkpoint_need(cfg(tmp_path / "run", tmp_path / "absent")) == diskspace.MARGIN
    assert diskspace.checkpoint_need(cfg(tmp_path / "run", tmp_path / "model", save_freq=0)) == diskspace.MARGIN


def test_a_saved_run_needs_what_its_newest_manifest_lists(tmp_path):
    bf16_model(tmp_path / "model")
    run = tmp_path / "run"
    for step, size in ((2, 5000), (4, 7000)):
        d = run / f"global_step_{step}"
        verified_io.make_private_dir(str(d / "actor"))
        (d / "actor" / "__0_0.distcp").write_bytes(b"x" * size)
        verified_io.save_plain({"step": step}, str(d / "trainer_state.pt"))
        verified_io.seal(str(d))
    newest = run / "global_step_4"
    listed = 7000 + os.path.getsize(newest / "trainer_state.pt") + os.path.getsize(newest / "manifest.json")
    assert diskspace.manifest_bytes(str(newest)) == listed
    (newest / "scratch.tmp").write_bytes(b"y" * 50_000)     # not the checkpoint's: the manifest does not list it
    assert diskspace.checkpoint_need(cfg(run, tmp_path / "model")) == listed + diskspace.MARGIN
    os.remove(newest / "manifest.json")                       # a step without one: its files as they lie
    assert diskspace.newest_checkpoint_bytes(str(run)) == diskspace.tree_bytes(str(newest))
