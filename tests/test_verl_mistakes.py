"""A verl user's common mistakes, each stopping with its one line and exit code 2 before
any rank starts, from a directory other than the repository's.

    python -m pytest -q tests/test_verl_mistakes.py

megarl.train.main runs in this process (the launcher part is what decides; spawn_ranks is replaced
by one that fails the test if reached), so an unreadable file can be simulated by making `open`
refuse it: the tests run as root, whom file permissions do not stop.
"""
from __future__ import annotations

import builtins
import importlib.util
import json
import os
import shutil

import pytest

import megarl.train as train_mod
from megarl.launcher.output import RankOutput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
ADDITION = os.path.join(ROOT, "data", "addition", "train.jsonl")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, addition_model_dir):
    """Every broken input, built once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import GPT2Config
    d = tmp_path_factory.mktemp("mistakes")
    rows = [json.loads(line) for line in open(ADDITION).readlines()[:40]]
    pq.write_table(pa.Table.from_pylist([{"question": r["prompt"][0]["content"], "data_source": r["data_source"]}
                                         for r in rows]), d / "no_prompt.parquet")
    (d / "three.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (d / "utf16.jsonl").write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode("utf-16"))
    (d / "locked.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "a_dir").mkdir()
    (d / "a_dir" / "train.jsonl").write_text("")
    (d / "reward_bad.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    return 1 / 0\n")
    (d / "reward_hangs.py").write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, "
                                       "extra_info=None):\n    time.sleep(3600)\n")
    for name, body in (("exits", "import os\n    os._exit(0)"), ("sys_exits", "import sys\n    sys.exit(3)"),
                       ("killed", "import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)")):
        (d / f"reward_{name}.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                             f"extra_info=None):\n    {body}\n")
    (d / "model_file").write_text("not a checkpoint")
    (d / "bad_tools.yaml").write_text("tools:\n  - {description: adds two numbers, parameters: {type: object}}\n")
    no_template = d / "no_template"
    shutil.copytree(addition_model_dir, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (d / "gpt2").mkdir()
    (d / "gpt2" / "config.json").write_text(json.dumps(GPT2Config(n_layer=2, n_embd=64, n_head=4).to_dict()))
    (d / "derived.yaml").write_text(f"base: {QUICKSTART}\nactor_rollout_ref:\n  model:\n    path: my-model\n")
    # verl's interaction file: a class whose module cannot import, and one whose constructor raises
    (d / "users.py").write_text("class Strict:\n    def __init__(self, config):\n        raise KeyError('persona')\n"
                                "    def respond(self, response, *, sample, turn):\n        return None\n")
    (d / "interaction_missing.yaml").write_text("interaction:\n  - {name: gsm8k, class_name: "
                                                "verl.interactions.gsm8k_interaction.Gsm8kInteraction, config: {}}\n")
    (d / "interaction_raises.yaml").write_text(f"interaction:\n  - {{name: u, class_name: '{d / 'users.py'}:Strict', "
                                               "config: {}}\n")
    (d / "reward_float.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                       "    return float(solution_str == str(ground_truth))\n")
    (d / "tagged.yaml").write_text("interaction:\n  - !!python/object/apply:os.system ['echo hi']\n")
    pickled = d / "pickled"
    shutil.copytree(addition_model_dir, pickled)
    for weights in pickled.glob("*.safetensors*"):
        weights.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch.save zip, never opened")
    lying = d / "lying"
    shutil.copytree(addition_model_dir, lying)
    weights = lying / "model.safetensors"
    blob = weights.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["shape"] = [dim * 2 for dim in header[first]["shape"]]      # claims more than it holds
    text = json.dumps(header).encode()
    weights.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n:])
    linked = d / "linked"
    shutil.copytree(addition_model_dir, linked)
    (linked / "model.safetensors").unlink()
    (d / "shadow").write_text("root:$6$saltsalt$hash:19000:0:99999:7:::\n")
    os.symlink(d / "shadow", linked / "model.safetensors")
    (d / "open_run").mkdir()
    os.chmod(d / "open_run", 0o775)
    names = ("no_prompt.parquet", "three.jsonl", "utf16.jsonl", "locked.jsonl", "a_dir", "reward_bad.py",
             "reward_hangs.py", "reward_exits.py", "reward_sys_exits.py", "reward_killed.py",
             "model_file", "bad_tools.yaml", "no_template", "gpt2", "derived.yaml", "interaction_missing.yaml",
             "interaction_raises.yaml", "reward_float.py", "tagged.yaml", "pickled", "open_run", "lying", "linked")
    return {k: str(d / k) for k in names} | {"model": addition_model_dir}


def run_main(args, cwd, monkeypatch, capsys):
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(train_mod, "spawn_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    code = train_mod.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


MISTAKES = [  # (id, overrides (MODEL = the working tiny model), the words of its one line)
    ("hub id as model.path", ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"],
     "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct"),
    ("typo in model.path", ["actor_rollout_ref.model.path=models/qwen-typo"], "models/qwen-typo does not exist"),
    ("model.path is a file", ["actor_rollout_ref.model.path=@model_file"], "is a file; give the HF checkpoint"),
    ("unsupported architecture", ["actor_rollout_ref.model.path=@gpt2"], "unsupported architecture model_type='gpt2'"),
    ("parquet without prompt", ["data.train_files=@no_prompt.parquet"], "has no 'prompt' column (it has: question"),
    ("no chat template", ["actor_rollout_ref.model.path=@no_template"], "the tokenizer has no chat template"),
    ("every prompt too long", ["data.max_prompt_length=2", "actor_rollout_ref.rollout.max_model_len=null"],
     "prompts sampled across"),
    ("batch larger than rows", ["data.train_files=@three.jsonl"],
     "data.train_batch_size: data.train_batch_size=32 is larger than the 3 usable prompts"),
    ("reward raises", ["custom_reward_function.path=@reward_bad.py"], "reward_bad.py:2"),
    ("reward hangs", ["custom_reward_function.path=@reward_hangs.py", "reward_model.timeout_s=0.5"],
     "did not return within reward_model.timeout_s=0.5 s"),
    ("reward os._exit", ["custom_reward_function.path=@reward_exits.py"], "ended the reward's process (exit code 0"),
    ("reward sys.exit", ["custom_reward_function.path=@reward_sys_exits.py"], "called sys.exit(3) at "),
    ("reward killed", ["custom_reward_function.path=@reward_killed.py"], "ended the reward's process (signal SIGKILL)"),
    ("UTF-16 data file", ["data.train_files=@utf16.jsonl"], "utf16.jsonl is not UTF-8 text (it starts with a UTF-16"),
    ("directory as data file", ["data.train_files=@a_dir"], "a_dir is a directory; give the data file itself, e.g."),
    ("tool without a name", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                             "actor_rollout_ref.rollout.tools=@bad_tools.yaml"], "needs a `name`"),
    ("verl key off its default", ["trainer.critic_warmup=2"], "critic warm-up steps are not implemented"),
    # what each rank's build_agent_loop would hit, seconds after the ranks start
    ("interaction cannot import", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                   "actor_rollout_ref.rollout.multi_turn.interaction_config_path=@"
                                   "interaction_missing.yaml"], "cannot import module 'verl.interactions"),
    ("interaction constructor raises", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                        "actor_rollout_ref.rollout.multi_turn.interaction_config_path=@"
                                        "interaction_raises.yaml"], "cannot construct"),
    ("filter on a field the reward lacks", ["custom_reward_function.path=@reward_float.py",
                                            "algorithm.filter_groups.enable=true",
                                            "algorithm.filter_groups.metric=acc"],
     "algorithm.filter_groups.metric: 'acc' is not a field the reward gives (scoring the first training row, it "
     "returned only a number)"),
    ("interactions file with a YAML tag", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                           "actor_rollout_ref.rollout.multi_turn.interaction_config_path=@tagged.yaml"],
     "tagged.yaml is not valid YAML at line 2, column 5: could not determine a constructor for the tag"),
    ("weights only as a pickle", ["actor_rollout_ref.model.path=@pickled"],
     "holds its weights only as pytorch_model.bin, a pickle megarl does not load"),
    ("safetensors header that lies", ["actor_rollout_ref.model.path=@lying"],
     "model.safetensors says tensor lm_head.weight of shape [32, 256] (F32) takes 8192 bytes, not 32768"),
    ("weight file linked to a secret", ["actor_rollout_ref.model.path=@linked"],
     "model.safetensors is not a safetensors file (no header of a valid length)"),
    # verl's run_qwen2-7b_rm.sh with a causal LM as the reward model: --check names it, not a rank's traceback
    ("reward model without a score head", ["reward_model.enable=true", "reward_model.model.path=@model"],
     "Qwen2ForCausalLM, which has no `score` head; give an HF *ForSequenceClassification checkpoint"),
    ("critic from a path without a score head", ["algorithm.adv_estimator=gae", "critic.model.init_from=path",
                                                 "critic.model.path=@model"], "set critic.model.init_from=actor"),
    ("run directory writable by its group", ["trainer.default_local_dir=@open_run"],
     "open_run is writable by group (mode 775), so no resume would trust its checkpoints; chmod 700"),
]
if not __import__("torch").cuda.is_available():
    MISTAKES.append(("cuda without a GPU", ["trainer.device=cuda"], "trainer.device: cuda, but this machine has no"))
if importlib.util.find_spec("tensorboard") is None:
    MISTAKES.append(("tensorboard missing", ["trainer.logger=[console,tensorboard]"],
                     "the 'tensorboard' package is not installed; pip install tensorboard"))


# A launch runs the same preflight as --check; these confirm it stops before spawn_ranks too.
AS_LAUNCH = ("hub id as model.path", "model.path is a file", "parquet without prompt", "batch larger than rows",
             "reward raises", "reward os._exit", "reward sys.exit", "cuda without a GPU")
# --check on a machine without a GPU is a login node's: it lists the GPU as checked on the nodes
# (tests/test_memory_plan.py's login-node case); a launch there stops.
LAUNCH_ONLY = ("cuda without a GPU",)


@pytest.mark.parametrize("check", ["--check", "launch"])
def test_each_mistake_is_one_line_and_exit_2(tmp_path, inputs, monkeypatch, capsys, check):
    """With --check (every mistake) and as a launch (which must stop before spawn_ranks)."""
    for name, overrides, words in MISTAKES:
        if (check == "launch" and name not in AS_LAUNCH) or (check == "--check" and name in LAUNCH_ONLY):
            continue
        overrides = [o.split("=", 1)[0] + "=" + (inputs[o.split("=", 1)[1][1:]] if o.split("=", 1)[1][:1] == "@"
                                                else o.split("=", 1)[1]) for o in overrides]
        model = [] if any("model.path" in o for o in overrides) else [f"actor_rollout_ref.model.path={inputs['model']}"]
        args = ["--config", QUICKSTART, *model, *overrides] + (["--check"] if check == "--check" else [])
        code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
        assert code == 2, (name, out, err)
        assert err.startswith("megarl: config error: ") and err.count("\n") == 1, (name, err)
        assert words in err and "Traceback" not in err, (name, err)
        assert os.listdir(tmp_path) in ([], ["runs"]), (name, os.listdir(tmp_path))   # no model built here


def test_a_bootstrap_builds_only_its_own_path(tmp_path, inputs, monkeypatch, capsys):
    """A config that inherits quickstart's bootstrap but names another path loads that path."""
    code, _, err = run_main(["--config", inputs["derived.yaml"], "--check"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "my-model does not exist" in err and "bootstrap builds only the path its own" in err
    assert not os.path.exists(os.path.join(os.path.dirname(inputs["derived.yaml"]), "my-model"))
    # Naming the bootstrap on the command line makes the command line its config: the path is its own.
    code, out, _ = run_main(["--config", inputs["derived.yaml"], "--check", "actor_rollout_ref.model.bootstrap="
                             "megarl.examples.addition:bootstrap", f"actor_rollout_ref.model.path={tmp_path}/new"],
                            tmp_path, monkeypatch, capsys)
    assert code == 0 and "check out" in out and not os.path.exists(tmp_path / "new")


def test_an_existing_directory_is_never_bootstrapped_over(tmp_path, monkeypatch, capsys):
    (tmp_path / "half").mkdir()
    code, _, err = run_main(["--config", QUICKSTART, "--check", "actor_rollout_ref.model.bootstrap="
                             "megarl.examples.addition:bootstrap", f"actor_rollout_ref.model.path={tmp_path}/half"],
                            tmp_path, monkeypatch, capsys)
    assert code == 2 and "exists but holds no config.json; the bootstrap builds only into a path that does not" in err


def test_unreadable_data_file(tmp_path, inputs, monkeypatch, capsys):
    real_open = builtins.open

    def guarded(file, *a, **k):
        if str(file) == inputs["locked.jsonl"]:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    code, _, err = run_main(["--config", QUICKSTART, f"actor_rollout_ref.model.path={inputs['model']}",
                             f"data.train_files={inputs['locked.jsonl']}", "--check"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "cannot read" in err and "locked.jsonl (Permission denied)" in err and "Traceback" not in err


def test_verl_keys_at_their_defaults_pass_check(tmp_path, inputs, monkeypatch, capsys):
    code, out, err = run_main(["--config", QUICKSTART, f"actor_rollout_ref.model.path={inputs['model']}", "--check",
                               "trainer.critic_warmup=0", "actor_rollout_ref.actor.fsdp_config.param_offload=false",
                               "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
                               "trainer.default_hdfs_dir=null", "trainer.val_only=false",
                               "actor_rollout_ref.actor.megatron.use_dist_checkpointing=false"],
                              tmp_path, monkeypatch, capsys)
    assert code == 0 and "check out" in out, err


def test_a_rank_config_error_is_the_last_console_line(tmp_path):
    """Once a rank prints its config error, torchrun's tracebacks go to the log, not the console."""
    import io
    console = io.BytesIO()
    records = tmp_path / "own-lines"                 # what the rank recorded as its own (own_line)
    records.write_text("megarl: config error: data.train_files: x; fix\n")
    echo = RankOutput(console, "run/logs/megarl-1.log", str(records))
    for chunk in (b"megarl: starting 2 processes\nmegarl: config error: data.train_files: x; fix", b"\nTraceback (most",
                  b" recent call last):\n  File ...\ntorch.distributed.elastic...ChildFailedError\n"):
        echo.write(chunk)
    assert echo.exit_code(1) == 2
    assert console.getvalue().decode().splitlines() == [
        "megarl: starting 2 processes", "megarl: config error: data.train_files: x; fix",
        "megarl: stopped the ranks; the ranks' full output is in run/logs/megarl-1.log"]


@pytest.mark.parametrize("reward, words", [("reward_exits.py", "ended the reward's process (exit code 0"),
                                           ("reward_sys_exits.py", "called sys.exit(3) at ")])
def test_a_reward_that_exits_stops_check_with_exit_2(tmp_path, inputs, reward, words):
    """In its own process: a reward that ends the launcher's process must be seen from outside it."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-m", "megarl.train", "--config", QUICKSTART, "--check",
                          f"actor_rollout_ref.model.path={inputs['model']}",
                          f"custom_reward_function.path={inputs[reward]}"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT})
    assert got.returncode == 2 and words in got.stderr and got.stderr.count("\n") == 1, (got.returncode, got.stderr)
