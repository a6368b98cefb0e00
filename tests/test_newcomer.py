"""A newcomer's first hour: the README's quickstart from another directory, and each bad
input stopping with its one line before any rank starts.

    python -m pytest -q tests/test_newcomer.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from tests.helpers.checkout import config_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


def train(args: list[str], cwd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "megarl.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_readme_quickstart_from_another_directory(tmp_path):
    """`megarl-train --config <abs>/configs/quickstart.yaml` run from an empty directory: the config's
    relative data and model paths resolve against configs/, the run directory (with logs/) lands in
    the current directory, and the console shows no warning nobody can act on. The config is a copy
    beside the shipped data, so its model is bootstrapped there as on a fresh clone, not taken from
    the checkout's runs/."""
    config = config_copy(tmp_path / "clone")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = train(["--config", config, "trainer.total_training_steps=3", "trainer.test_freq=-1"], str(cwd),
                timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "step 3/3" in text
    # TE/Apex and CUDA_DEVICE_MAX_CONNECTIONS notices are filtered; megarl's own are fixed at the source.
    noise = [line for line in text.splitlines() if "Warning" in line]
    assert not noise, noise
    assert "train data: " in text and "val data: 512 of 512 rows kept" in text
    run_dir = cwd / "runs" / "megarl" / "quickstart"
    logs = list((run_dir / "logs").glob("megarl-*.log"))
    assert len(logs) == 1 and "step 3/3" in logs[0].read_text()
    assert sorted(os.listdir(cwd)) == ["runs"]               # nothing bootstrapped into the cwd
    model = os.path.join(os.path.dirname(os.path.dirname(config)), "runs", "models", "addition-qwen2")
    assert os.path.isfile(os.path.join(model, "config.json"))        # but beside the config's folder


BAD = [  # (overrides, the words of its one line)
    (["custom_reward_function.path=nonexistent.py"], "custom_reward_function.path: file not found:"),
    (["data.train_files=missing.jsonl"], "data.train_files: data file not found:"),
    (["data.train_files=EMPTY"], "holds no rows"),
    (["actor_rollout_ref.model.bootstrap=null", "actor_rollout_ref.model.path=no_model_here"],
     "actor_rollout_ref.model.path: "),
    (["actor_rollout_ref.rollout.name=vllm"], "free_cache_engine: =true asks the vllm engine to sleep"),
    (["actor_rollout_ref.rollout.name=sglang"], "sglang is not integrated in megarl"),
    (["actor_rollout_ref.rollout.name=trtllm"], "needs the 'tensorrt_llm' package"),
    (["actor_rollout_ref.rollout.response_length=0"], "actor_rollout_ref.rollout.response_length: must be >= 1"),
    (["trainer.default_local_dir=/proc/megarl-cannot-write"], "trainer.default_local_dir: cannot write to"),
    (["data.max_response_length=100"], "exceed the model's 64 positions"),
    (["actor_rollout_ref.rollout.max_model_len=8"], "actor_rollout_ref.rollout.max_model_len: 8 is less than"),
    (["actor_rollout_ref.rollout.quantization=fp8"], "is not supported"),
    (["actor_rollout_ref.model.external_lib=no_such_module"], "cannot import 'no_such_module'"),
    (["custom_reward_function.path=BADSIG"], "cannot be called as (data_source, solution_str, ground_truth"),
    (["actor_rollout_ref.rollout.tools=VERLTOOLS"], "is a verl tool class, which megarl does not run"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=48"], "not divisible by ppo_micro_batch_size_per_gpu"),
]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, addition_model_dir):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_text("")
    (d / "badsig.py").write_text("def compute_score(answer):\n    return 0.0\n")
    (d / "tools.yaml").write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n"
                                  "    tool_schema: {type: function, function: {name: calc}}\n")
    return {"EMPTY": str(d / "empty.jsonl"), "BADSIG": str(d / "badsig.py"), "VERLTOOLS": str(d / "tools.yaml"),
            "model": addition_model_dir}


@pytest.mark.parametrize("overrides,words", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_line_before_any_rank(tmp_path, bad_inputs, overrides, words):
    overrides = [o.split("=")[0] + "=" + bad_inputs.get(o.split("=", 1)[1], o.split("=", 1)[1]) for o in overrides]
    model = [] if any("model.path" in o for o in overrides) else [f"actor_rollout_ref.model.path={bad_inputs['model']}"]
    start = time.monotonic()
    out = train(["--config", QUICKSTART, *model, *overrides], str(tmp_path))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.startswith("megarl: config error: ") and out.stderr.count("\n") == 1, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr
    assert "starting" not in out.stdout                      # no process was spawned
    assert time.monotonic() - start < 30


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(f"base: {QUICKSTART}\ntrainer:\n  seed: 1\n  save_freq: 5\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"key 'seed' appears twice \(lines 3 and 5\); keep one"):
        load_config(str(path))


def test_relative_paths_follow_the_file_and_the_command_line_follows_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yaml").write_text("data: {val_files: v.jsonl}\n")
    (tmp_path / "exp.yaml").write_text("base: sub/base.yaml\ndata: {train_files: [a.jsonl, /abs/b.jsonl]}\n"
                                       "custom_reward_function: {path: my_pkg.rewards}\n")
    monkeypatch.chdir("/")
    cfg = load_config(str(tmp_path / "exp.yaml"), ["actor_rollout_ref.model.path=rel/model"])
    assert cfg.data.train_files == [str(tmp_path / "a.jsonl"), "/abs/b.jsonl"]
    assert cfg.data.val_files == [str(tmp_path / "sub" / "v.jsonl")]      # a base's paths: from its folder
    assert cfg.custom_reward_function.path == "my_pkg.rewards"           # a module name stays one
    assert cfg.model.path == "rel/model"                                  # command line: the cwd's


def test_second_writer_stops_naming_the_holder(tmp_path, addition_model_dir):
    from megarl.parallel.lifecycle import RunDirLock
    run_dir = tmp_path / "run"
    lock = RunDirLock(str(run_dir)).acquire()
    try:
        out = train(["--config", QUICKSTART, f"actor_rollout_ref.model.path={addition_model_dir}",
                     f"trainer.default_local_dir={run_dir}"], str(tmp_path))
    finally:
        lock.release()
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"in use by another run (pid {os.getpid()} on host " in out.stderr


def test_a_rank_dies_with_its_launcher(tmp_path):
    """kill -9 of the launcher: the child that asked for the parent-death signal goes too."""
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c",
            "import sys, time; sys.path.insert(0, {ROOT!r}); from megarl.parallel.lifecycle import die_with_parent;"
            "print(die_with_parent(), flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)
        import time; time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid, how = launcher.stdout.readline().split()
    assert how == "prctl"
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    for _ in range(50):
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:     # a zombie (not yet reaped by init) is dead too
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError("the rank outlived its launcher")


# -- evaluation honesty ------------------------------------------------------------------------------
def _dataset(tmp_path, rows, split="val", **over):
    from megarl.data.config import DataConfig
    from megarl.data.dataset import RLDataset
    from megarl.examples.addition.model import build_tokenizer
    path = tmp_path / f"{split}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=[str(path)], val_files=[str(path)], chat_template="plain", **over)
    return RLDataset([str(path)], build_tokenizer(), cfg, split=split)


def test_validation_never_drops_rows_silently(tmp_path):
    rows = [{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "data_source": "addition"}] * 3
    rows += [{"prompt": "1" * 40 + "+2=", "reward_model": {"ground_truth": "0"}, "data_source": "addition"}]
    with pytest.raises(ConfigError, match=r"1 of 4 validation rows would be dropped \(1 over max_prompt_length=16"):
        _dataset(tmp_path, rows, max_prompt_length=16)
    ds = _dataset(tmp_path, rows, max_prompt_length=16, max_val_dropped_fraction=0.5)
    assert ds.summary() == ("val data: 3 of 4 rows kept; dropped 0 malformed, 1 over data.max_prompt_length=16; "
                            "truncated 0")
    assert len(_dataset(tmp_path, rows, split="train", max_prompt_length=16)) == 3   # training may drop, counted


def test_messages_ending_with_the_answer_follow_verls_convention(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}],
             "data_source": "addition"},
            {"prompt": [{"role": "assistant", "content": "4"}], "data_source": "addition"}]
    ds = _dataset(tmp_path, rows, split="train", max_bad_row_fraction=0.5)
    assert len(ds) == 1 and ds.report["malformed"] == 1
    from megarl.examples.addition.model import build_tokenizer
    assert build_tokenizer().decode(ds[0]["prompt_token_ids"]) == "2+2="        # the answer is not in the prompt
    assert ds[0]["reward_model"]["ground_truth"] == "4"


# -- reward deadline, resume, logs ---------------------------------------------------------------------
def test_reward_deadline_names_the_function_and_the_slowest_samples(tmp_path):
    from megarl.reward.loading import RewardFnSpec
    from megarl.reward.settings import RewardSettings
    from megarl.reward.manager import RewardDeadline, RewardManager
    from megarl.reward.scorers import BatchedScorer, InProcessScorer
    from tests.helpers.reward import rollout_batch, tokenizer
    fn = tmp_path / "slow.py"
    fn.write_text("import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    time.sleep(0.4 if extra_info['index'] == 1 else 0.01)\n    return 1.0\n"
                  "def batched(data_sources, solution_strs, ground_truths, extra_infos):\n"
                  "    time.sleep(30)\n")
    batch = rollout_batch(["3", "4", "5", "6"], ["3", "4", "5", "6"])
    manager = RewardManager(tokenizer(), InProcessScorer(tokenizer(), RewardFnSpec(str(fn)), timeout_s=10),
                            RewardSettings(deadline_s=0.3))
    with pytest.raises(RewardDeadline) as err:
        manager(batch)
    msg = str(err.value)
    assert f"custom_reward_function {fn}:compute_score" in msg and "batch_deadline_s=0.3s" in msg
    assert "slowest: #1 (data_source addition)" in msg and "still running" in msg and "\n" not in msg
    batched = RewardManager(tokenizer(), BatchedScorer(tokenizer(), RewardFnSpec(str(fn), "batched", batched=True)),
                            RewardSettings(deadline_s=0.3))
    begin = time.monotonic()
    with pytest.raises(RewardDeadline, match=f"scoring with custom_reward_function {fn}:batched"):
        batched.result(batched.compute_async(batch))
    assert time.monotonic() - begin < 10


def test_incomplete_save_is_skipped_and_moved_aside_and_damage_names_resume_mode(tmp_path):
    import torch

    from megarl.trainer.checkpoints import checkpointing
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "global_step_2", "actor"))        # trainer_state.pt deleted
    assert checkpointing.incomplete_steps(root) == [2] and checkpointing.latest_step_dir(root) is None
    said = []
    checkpointing.save(root, 2, {}, {"step": 2}, rank=0, keep=None, say=said.append)
    assert os.path.isdir(os.path.join(root, "global_step_2.incomplete", "actor"))
    assert said == [f"megarl: {root}/global_step_2 had no trainer_state.pt (an incomplete save); moved it to "
                    f"{root}/global_step_2.incomplete"]
    state = os.path.join(root, "global_step_2", "trainer_state.pt")
    data = open(state, "rb").read()
    open(state, "wb").write(data[: len(data) // 2])                   # a truncated file
    with pytest.raises(ConfigError) as err:
        checkpointing.load(os.path.join(root, "global_step_2"), {}, rank=0, world=1)
    assert str(err.value).startswith("trainer.resume_mode: cannot resume from global_step_2: trainer_state.pt is "
                                     "truncated")   # named before anything is loaded (docs/reliability.md)
    assert "trainer.resume_mode=disable" in str(err.value) and "\n" not in str(err.value)
    torch.save({"step": 2}, state)


def test_known_noise_is_filtered_unless_verbose(monkeypatch):
    from megarl.launcher import logs
    for verbose, shown in ((False, 0), (True, 1)):
        monkeypatch.setenv(logs.VERBOSE_ENV, "1" if verbose else "0")
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            logs.quiet_known_noise(cpu=True)
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
            warnings.warn("something about the user's data")
        assert len(got) == 1 + shown


def test_verl_spellings_and_imports():
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ["console"]
    from megarl import DataProto
    assert DataProto.__module__ == "megarl.protocol"


def test_configuration_page_example_checks_out(tmp_path, addition_model_dir):
    text = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    first = block.split("\n")[:3]
    args = " ".join(line.rstrip("\\ ") for line in first).split()[1:]
    assert args[:2] == ["--config", "configs/quickstart.yaml"]
    out = train(["--config", QUICKSTART, *args[2:], f"actor_rollout_ref.model.path={addition_model_dir}", "--check"],
                str(tmp_path))
    assert out.returncode == 0 and "config and inputs check out" in out.stdout, out.stderr
