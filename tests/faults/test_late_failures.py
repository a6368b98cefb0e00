"""Inputs the ranks would stop on only after they start (after step 1, at the first validation, or
when vLLM sizes its cache), refused by `--check` and every launch in one line before anything runs.
Each case goes through megarl's real config loader and preflight in this process, on the quickstart's
model; one spawn of `megarl-train --check` shows the line a user sees.

    python -m pytest -q tests/faults/test_late_failures.py
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
from megarl.launcher.preflight_run import check_engine_kwarg_values, check_output_paths

QUICKSTART = "configs/quickstart.yaml"


def rows(sources: list[str]) -> str:
    return "".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": s,
                               "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i, s in enumerate(sources))


@pytest.fixture
def base(tmp_path, addition_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text(rows(["addition"] * 40))
    return [f"actor_rollout_ref.model.path={addition_model_dir}", f"data.train_files={data}", "data.val_files=[]",
            f"trainer.default_local_dir={tmp_path / 'run'}"]


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        preflight(load_config(QUICKSTART, overrides))
    return str(caught.value)


def test_the_base_config_passes(base):
    preflight(load_config(QUICKSTART, base))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode")
def test_a_generation_dump_directory_that_cannot_be_written(base, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for key in ("rollout_data_dir", "validation_data_dir"):
        for path in (locked, locked / "dumps"):
            line = refusal([*base, f"trainer.{key}={path}"])
            assert line.startswith(f"trainer.{key}: cannot create or write {path}"), line


def test_a_generation_dump_directory_under_a_file(base, tmp_path):
    (tmp_path / "a_file").write_text("")
    line = refusal([*base, f"trainer.rollout_data_dir={tmp_path / 'a_file' / 'dumps'}"])
    assert line.startswith("trainer.rollout_data_dir: cannot create or write") and "Not a directory" in line, line


def test_tensorboard_directory_that_is_a_file(base, tmp_path):
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "run" / "tensorboard").write_text("")
    # check_output_paths alone: preflight first asks for the tensorboard package, which CI may lack.
    cfg = load_config(QUICKSTART, [*base, "trainer.logger=[console,tensorboard]"])
    with pytest.raises(ConfigError, match=f"^trainer.logger: {tmp_path / 'run' / 'tensorboard'} is a file"):
        check_output_paths(cfg)
    (tmp_path / "logs").mkdir(mode=0o700)
    check_output_paths(load_config(QUICKSTART, [*base, "trainer.logger=[console,tensorboard]",
                                                f"trainer.log_dir={tmp_path / 'logs'}"]))


@pytest.mark.parametrize("value", ["inf", "1e30", "31536001"])
def test_a_collective_timeout_that_overflows_on_the_ranks(base, value):
    with pytest.raises(ConfigError, match=r"collective_timeout_s: must be a finite number of seconds up to 31536000"):
        load_config(QUICKSTART, [*base, f"trainer.collective_timeout_s={value}"])


@pytest.mark.parametrize("value", ["-1", "0", "1.5", "true", "'1GB'"])
def test_a_kv_cache_size_vllm_would_take_unchecked(base, value):
    # The check alone: vLLM's own head-size check refuses the quickstart's model (configs/quickstart_vllm.yaml).
    def config(size: str):
        return load_config(QUICKSTART, [*base, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout."
                                        "free_cache_engine=false", "actor_rollout_ref.rollout.enable_sleep_mode=false",
                                        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={size}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes: "
                                          r"is .*; give a positive whole number of bytes"):
        check_engine_kwarg_values(config(value))
    check_engine_kwarg_values(config(str(2 << 30)))


def test_a_data_source_without_a_scorer_past_the_first_row(base, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(rows(["addition"] * 30 + ["my_new_task"] + ["addition"] * 9))
    line = refusal([*base, f"data.train_files={data}"])
    assert line.startswith(f"data.train_files: {data}: line 31: no built-in reward rule for data source(s) "
                           "'my_new_task'"), line
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    val = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(r) for r in rows(["addition", "gsm8k", "codeforces"])
                                         .splitlines()]), val)
    line = refusal([*base, f"data.val_files=[{val}]"])
    assert line.startswith(f"data.val_files: {val}: row 3: data source(s) 'codeforces'"), line
    # A user's scorer knows its own sources: nothing is refused for them.
    scorer = tmp_path / "score.py"
    scorer.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 0.0, 'acc': 0.0}\n")
    preflight(load_config(QUICKSTART, [*base, f"data.train_files={data}", f"custom_reward_function.path={scorer}",
                                       "custom_reward_function.name=score"]))


def test_check_says_it_in_one_line_before_starting_anything(base, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(rows(["addition"] * 5 + ["nobody_scores_this"]))
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", QUICKSTART, "--check", *base,
                          f"data.train_files={data}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        f"megarl: config error: data.train_files: {data}: line 6: no built-in reward rule for data source(s) "
        "'nobody_scores_this' (the data.reward_fn_key field); built in: verl 0.9.1's gsm8k/MATH/math_dapo/aime/"
        "searchR1 rules, gsm8k, MATH-style boxed answers, addition/integer; set custom_reward_function.path to "
        "score other data"], out.stderr
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")
