"""Files and configs crafted against megarl, each met by its real reader in this process: one line
naming the file and the cause (or the bad row skipped and named), never a traceback, never the
content of a file that is not megarl's.

    python -m pytest -q tests/faults/test_hostile_inputs.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.config.loader import read_yaml
from megarl.data.reading import read_rows
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.trainer.checkpoints import checkpointing, verified_io
from megarl.trainer.metrics.logger import MetricsLogger, MetricsWriteError, read_metrics
from megarl.trainer.metrics.plot import plot_after_run

SECRET = "root:$6$saltsalt$NotARealHashButSecret:19000:0:99999:7:::\n"


def _sealed_step(root, step=3):
    d = root / f"global_step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "a.distcp").write_bytes(b"weights")
    (d / "trainer_state.pt").write_bytes(b"state")
    os.chmod(root, 0o700)
    verified_io.seal(str(d))
    return d


def test_a_pointer_holding_a_digit_int_refuses_falls_back_to_the_newest_step(tmp_path):
    _sealed_step(tmp_path, 3)
    (tmp_path / checkpointing.POINTER).write_text("\u00b2")      # '²'.isdigit() is True, int('²') raises
    assert checkpointing.latest_step_dir(str(tmp_path)) == checkpointing.step_dir(str(tmp_path), 3)
    (tmp_path / checkpointing.POINTER).write_bytes(b"\xff\xfe3")
    assert checkpointing.latest_step_dir(str(tmp_path)) == checkpointing.step_dir(str(tmp_path), 3)


@pytest.mark.parametrize("bytes_value", [[7, 5], "7", {"actor/a.distcp": "7"}, {"actor/a.distcp": 7.0}])
def test_a_manifest_whose_bytes_are_of_the_wrong_type_is_refused(tmp_path, bytes_value):
    step = _sealed_step(tmp_path)
    manifest = json.loads((step / verified_io.MANIFEST).read_text())
    manifest["bytes"] = bytes_value
    (step / verified_io.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(verified_io.Refused, match=r"manifest.json cannot be read \(ValueError: 'bytes' is not a map "
                                                  r"of file names to integer sizes\)"):
        verified_io.verify(str(step))


def test_a_step_directory_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = _sealed_step(elsewhere, 3)
    verified_io.verify(str(real))                                # the step itself checks out
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.symlink(real, run / "global_step_3")
    with pytest.raises(verified_io.Refused, match=r"global_step_3\) is a symbolic link \(to .*elsewhere/global_step_3"
                                                  r"\); a step directory is read only where it was saved"):
        verified_io.verify(str(run / "global_step_3"))


def test_an_index_that_sends_a_tensor_out_of_the_model_directory_is_refused_naming_it(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../../etc/shadow"}}))
    with pytest.raises(ValueError) as info:
        HFCheckpoint(str(model)).names()
    assert str(info.value) == (f"{model}/model.safetensors.index.json: weight_map sends tensors to '../../etc/shadow', "
                               f"which is not a *.safetensors file in {model}; fix or remove the index")


def test_a_base_linked_to_a_secret_is_refused_without_echoing_it(tmp_path):
    (tmp_path / "shadow").write_text(SECRET)
    os.symlink(tmp_path / "shadow", tmp_path / "base_link")
    (tmp_path / "run.yaml").write_text("base: base_link\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "run.yaml"), [])
    assert "not a .yaml/.yml file" in str(info.value) and "Secret" not in str(info.value)
    os.symlink(tmp_path / "shadow", tmp_path / "base.yaml")     # named .yaml: where it leads is what counts
    (tmp_path / "run.yaml").write_text("base: base.yaml\n")
    with pytest.raises(ConfigError, match="shadow, not a .yaml/.yml file"):
        load_config(str(tmp_path / "run.yaml"), [])
    # Such lines in a real .yaml file: what is no key name is not echoed either.
    (tmp_path / "copied.yaml").write_text(SECRET)
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "copied.yaml"), [])
    assert re.search(r"a key of \d+ characters that is not a name", str(info.value)), info.value
    assert "Secret" not in str(info.value)


def test_yaml_merge_keys_merge_and_explicit_keys_win(tmp_path):
    (tmp_path / "m.yaml").write_text("trainer: &t\n  save_freq: 3\n  test_freq: 4\n"
                                     "reward_model:\n  <<: [{timeout_s: 7}, {num_workers: 3}]\n  timeout_s: 9\n")
    assert read_yaml(str(tmp_path / "m.yaml"))["reward_model"] == {"timeout_s": 9, "num_workers": 3}
    cfg = load_config(str(tmp_path / "m.yaml"), [])
    assert (cfg.reward_model.timeout_s, cfg.reward_model.num_workers, cfg.trainer.save_freq) == (9, 3, 3)
    (tmp_path / "d.yaml").write_text("trainer:\n  <<: {save_freq: 1}\n  save_freq: 2\n  save_freq: 3\n")
    with pytest.raises(ConfigError, match="key 'save_freq' appears twice"):
        read_yaml(str(tmp_path / "d.yaml"))


def test_rows_with_lone_surrogates_bad_bytes_or_deep_nesting_are_named_and_skipped(tmp_path):
    good = {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}
    path = tmp_path / "train.jsonl"
    with open(path, "wb") as f:
        f.write((json.dumps(good) + "\n").encode())
        f.write(b'{"prompt": "bad \\ud800 half", "reward_model": {"ground_truth": "1"}}\n')
        f.write(b'{"prompt": "pair \\ud83d\\ude00 ok", "reward_model": {"ground_truth": "1"}}\n')
        f.write(b'{"prompt": "latin-1 \xe9", "reward_model": {"ground_truth": "1"}}\n')
        f.write(('{"prompt": "deep", "reward_model": {"ground_truth": ' + "[" * 100_000 + "]" * 100_000 + "}}\n")
                .encode())
        f.write((json.dumps(good) + "\n").encode())
    got = read_rows(str(path))
    assert [where for where, _ in got.rows] == ["line 1", "line 3", "line 6"]
    assert got.rows[1][1]["prompt"] == "pair \U0001F600 ok"
    reasons = {b.where: b.reason for b in got.bad}
    assert reasons["line 2"].startswith("a lone UTF-16 surrogate \\ud800 in the string 'bad \\ud800 half'")
    assert reasons["line 4"] == "bytes that are not UTF-8 at character 21; re-save the file as UTF-8"
    assert reasons["line 5"].startswith("nested too deeply to parse")


def test_a_full_disk_under_metrics_takes_back_the_torn_line_and_the_plot_adds_one_line(tmp_path):
    """A 64 KiB tmpfs (the suite runs as root); elsewhere skipped."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("no tmpfs (not root)")
    try:
        log = MetricsLogger(str(disk), ["console"], "p", "e", stream=open(os.devnull, "w"))
        log.log(1, {"critic/score/mean": 0.5})
        with open(disk / "filler", "wb", buffering=0) as f:      # leave less room than one record needs
            try:
                while True:
                    f.write(b"\0" * 512)
                    f.flush()
            except OSError:
                pass
        with pytest.raises(MetricsWriteError) as info:
            log.log(2, {"critic/score/mean": 0.25, "padding": "x" * 8000})
        assert str(info.value).startswith(f"writing step 2's metrics to {disk}/metrics.jsonl failed (No space left")
        assert [r["step"] for r in read_metrics(str(disk))] == [1]
        assert (disk / "metrics.jsonl").read_text().endswith("}\n")       # no torn line
        said = []
        plot_after_run(str(disk), said.append)
        assert len(said) == 1 and said[0].startswith("megarl: the reward curve was not written (OSError"), said
        assert not (disk / "reward_curve.png").exists() and not (disk / "reward_curve.png.tmp.png").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
