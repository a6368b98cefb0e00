"""Every file in configs/ passes `--check` from another directory; the tiny ones also run one step.

    python -m pytest -q tests/test_configs_dir.py

The 7B examples need a model that is not here: they stop with one line naming it and the download
command. configs/quickstart.yaml's run from another directory is tests/test_newcomer.py's.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

import megarl.train as train_mod
from megarl.experiment import load_config
from tests.helpers.checkout import config_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
NEEDS_A_DOWNLOAD = {"grpo_gsm8k_qwen2.5_7b.yaml", "ppo_gsm8k_qwen2.5_7b.yaml"}
# Checked here, not run: vLLM's engine is exercised by tests/rollout/test_vllm.py in one subprocess.
CHECK_ONLY = {"quickstart_vllm.yaml"}
# The tiny configs run here; bootstrap_kwargs shrink only the warm start (the model's shape stays).
TINY = {"grpo_moe_tiny.yaml": {"warm_start_steps": 5}, "quickstart_ppo.yaml": {"warm_start_steps": 5},
        "quickstart_lora.yaml": {"warm_start_steps": 5},
        "verl_gsm8k_tiny.yaml": {"warm_start_steps": 5}, "tool_use.yaml": {"steps": 5}}
# A 5-step warm start answers nothing right, so dynamic sampling would find no informative group.
TINY_OVERRIDES = {"quickstart_lora.yaml": ["algorithm.filter_groups.enable=false"]}


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    """verl's GSM8K parquet shape (megarl.examples.verl_gsm8k), for configs/verl_gsm8k_tiny.yaml's DATA."""
    from megarl.examples.verl_gsm8k import write
    d = tmp_path_factory.mktemp("verl_gsm8k")
    write(str(d), train=32, test=8)
    return str(d)


def test_the_list_is_complete():
    names = {os.path.basename(c) for c in CONFIGS}
    assert NEEDS_A_DOWNLOAD | CHECK_ONLY | set(TINY) | {"quickstart.yaml"} == names


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_check_from_another_directory(config, tmp_path, gsm8k_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA", gsm8k_dir)
    monkeypatch.delenv("MODEL", raising=False)
    monkeypatch.setattr(train_mod, "spawn_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    # a copy: the config as written, its ../runs/models unbuilt whatever the checkout's runs/ holds
    code = train_mod.main(["--config", config_copy(tmp_path / "clone", os.path.basename(config)), "--check"])
    out = capsys.readouterr()
    if os.path.basename(config) in NEEDS_A_DOWNLOAD:
        assert code == 2 and out.err.count("\n") == 1, out.err
        assert "hf download Qwen/Qwen2.5-7B-Instruct --local-dir models/Qwen2.5-7B-Instruct" in out.err
    elif (os.path.basename(config) in CHECK_ONLY and importlib.util.find_spec("vllm") is None
          and not os.environ.get("CI")):
        # Where vLLM is not installed (CI installs it), --check must say so in one line.
        assert code == 2 and out.err.count("\n") == 1, out.err
        assert "needs the 'vllm' package, which is not installed here" in out.err
    else:
        assert code == 0, out.err
        assert "config and inputs check out" in out.out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_config_runs_one_step(name, tmp_path, gsm8k_dir):
    """The config as written, for one step, with its own bootstrap building a briefly warmed model
    into a temporary directory (named on the command line, so that path is the bootstrap's own)."""
    config = os.path.join(ROOT, "configs", name)
    model = load_config(config).model
    kwargs = ", ".join(f"{k}: {v}" for k, v in {**model.bootstrap_kwargs, **TINY[name]}.items())
    args = ["--config", config, f"actor_rollout_ref.model.bootstrap={model.bootstrap}",
            f"actor_rollout_ref.model.path={tmp_path / 'model'}",
            f"actor_rollout_ref.model.bootstrap_kwargs={{{kwargs}}}",
            "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path / 'run'}",
            *TINY_OVERRIDES.get(name, [])]
    if model.tokenizer_path != model.path:                        # tool_use keeps its tokenizer in a subfolder
        args.append(f"actor_rollout_ref.model.tokenizer_path={tmp_path / 'model' / 'tokenizer'}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DATA=gsm8k_dir)
    out = subprocess.run([sys.executable, "-m", "megarl.train", *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=840)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "step 1/1" in text


def test_interpolated_paths_are_taken_from_the_config_folder(tmp_path, monkeypatch):
    """A path written with ${...} follows the rule of a path written out: relative to the file's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATA", raising=False)
    cfg = load_config(os.path.join(ROOT, "configs", "verl_gsm8k_tiny.yaml"))
    assert cfg.data.train_files == [os.path.join(ROOT, "data", "verl_gsm8k", "train.parquet")]
    monkeypatch.setenv("DATA", "../elsewhere")
    cfg = load_config(os.path.join(ROOT, "configs", "verl_gsm8k_tiny.yaml"))
    assert cfg.data.val_files == [os.path.join(ROOT, "elsewhere", "test.parquet")]
    monkeypatch.setenv("DATA", str(tmp_path))              # an absolute path stays as it is
    assert load_config(os.path.join(ROOT, "configs", "verl_gsm8k_tiny.yaml")).data.train_files == \
        [str(tmp_path / "train.parquet")]
    # on the command line a path is the working directory's, with or without a reference
    cfg = load_config(os.path.join(ROOT, "configs", "verl_gsm8k_tiny.yaml"),
                      ["data.train_files=${env:DATA}/t.parquet"])
    assert cfg.data.train_files == [str(tmp_path / "t.parquet")]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text(
        "trainer: {experiment_name: x}\ndata:\n  train_files: ${trainer.experiment_name}/a.parquet\n")
    assert load_config(str(tmp_path / "sub" / "c.yaml")).data.train_files == [str(tmp_path / "sub" / "x" / "a.parquet")]
