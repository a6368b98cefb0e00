"""What a `megarl-train` launch loads, and when: the launcher's paths that need no model code load
neither torch, transformers nor megatron (each a fresh interpreter, as a user starts it), and
torchrun's agent loads torch while the launcher checks the run, starting no rank until the checks pass.

    python -m pytest -q tests/test_launch_imports.py
"""
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megarl.launcher.held import HeldTorchrun
from megarl.train import free_port
from tests.helpers.training_runs import finish, train

HEAVY = ("torch", "transformers", "megatron")
# Runs megarl-train's own entry point; at exit (exit_now runs atexit) prints which heavy packages loaded.
ENTRY = textwrap.dedent("""
    import atexit, json, runpy, sys
    atexit.register(lambda: print("LOADED", json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {HEAVY}))))
    sys.argv = ["megarl-train", *sys.argv[1:]]
    runpy.run_module("megarl.train", run_name="__main__")
""").replace("{HEAVY}", repr(set(HEAVY)))


def loaded(*args):
    out = subprocess.run([sys.executable, "-c", ENTRY, *args], capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return out.returncode, json.loads(lines[-1][len("LOADED "):]), out.stdout + out.stderr


def test_the_entry_modules_and_the_config_load_no_model_code():
    code = ("import sys, megarl.train, megarl.launcher.cli, megarl.launcher.held, megarl.parallel.supervise;"
            "from megarl.launcher.cli import parse_args;"
            "from megarl.experiment import load_config;"
            "parse_args(['--config', 'configs/quickstart.yaml', 'trainer.total_training_steps=1']);"
            "load_config('configs/quickstart.yaml', ['trainer.total_training_steps=1']);"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_print_config_and_a_refused_input_load_no_model_code(tmp_path):
    rc, mods, out = loaded("--config", "configs/quickstart.yaml", "--print-config")
    assert rc == 0 and "trainer:" in out and mods == [], (mods, out[-2000:])
    rc, mods, out = loaded("--config", "configs/quickstart.yaml", f"trainer.default_local_dir={tmp_path / 'run'}",
                           f"data.train_files={tmp_path / 'absent.jsonl'}")
    assert rc == 2 and "megarl: config error: data.train_files: data file not found" in out, out[-2000:]
    assert mods == [], mods
    assert not (tmp_path / "run").exists()


REWARD = textwrap.dedent("""
    import json, os, psutil
    if "RANK" not in os.environ:    # the launcher, loading the reward during its checks
        me = psutil.Process()
        agents = [{"pid": p.pid, "cmd": p.cmdline(), "children": len(p.children())} for p in me.children()]
        with open(os.environ["SEEN"], "w") as f:
            json.dump(agents, f)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if os.environ.get("REFUSE"):
            raise ValueError("refused on purpose")
        return float(solution_str.strip() == str(ground_truth))
""")


def one_step(model_dir, tmp_path, env):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    args = [f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "algorithm.filter_groups.enable=false", f"custom_reward_function.path={reward}",
            "custom_reward_function.name=compute_score", "trainer.plot_reward_curve=false"]
    return finish(train(args, env={**os.environ, **env}), timeout=300)


@pytest.mark.timeout(360)
def test_torchrun_loads_during_the_checks_and_starts_ranks_after_them(addition_model_dir, tmp_path):
    seen = tmp_path / "seen.json"
    rc, out = one_step(addition_model_dir, tmp_path, {"SEEN": str(seen)})
    assert rc == 0 and "step 1/1" in out, out[-3000:]
    agents = json.loads(seen.read_text())
    # while the launcher loaded the reward, torchrun's agent was already there, and had started no rank
    assert [a["cmd"][1:4] for a in agents] == [["-m", "megarl.parallel.torchrun", "--held"]], agents
    assert agents[0]["children"] == 0
    assert "torch.distributed.run" not in out


@pytest.mark.timeout(360)
def test_a_run_refused_by_its_checks_ends_the_held_agent(addition_model_dir, tmp_path):
    seen = tmp_path / "seen.json"
    rc, out = one_step(addition_model_dir, tmp_path, {"SEEN": str(seen), "REFUSE": "1"})
    assert rc == 2, out[-3000:]
    assert "megarl: config error: custom_reward_function.path: scoring the first training row" in out
    assert "refused on purpose" in out and "megarl: starting" not in out
    agent = json.loads(seen.read_text())[0]["pid"]
    assert not psutil.pid_exists(agent)           # killed and reaped by the launcher, not left behind
    assert not (tmp_path / "run" / "logs").exists()


def test_go_sends_the_ranks_environment_as_a_change_and_cancel_ends_the_agent():
    """A real held torchrun, running `env` as its one worker: the worker sees the variables go()
    sets and not those it unsets, though a process the launcher forked (a reward check's) still
    holds the pipe; a cancelled agent is gone."""
    base = dict(os.environ, MEGARL_TEST_KEEP="1", MEGARL_TEST_DROP="1", PYTHONUNBUFFERED="1")
    agent = HeldTorchrun.start(base)
    holder = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    holder.start()
    env = {k: v for k, v in base.items() if k != "MEGARL_TEST_DROP"}
    env["MEGARL_TEST_ADDED"] = "yes"
    try:
        proc = agent.go(["--rdzv-backend=static", "--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1",
                         f"--master-port={free_port()}", "--nproc_per_node=1", "--no-python", "env"], env)
        assert proc is not None
        out, _ = proc.communicate(timeout=60)
    finally:
        holder.kill()
        holder.join()
    worker_env = dict(line.split("=", 1) for line in out.decode().splitlines() if line.startswith("MEGARL_TEST_"))
    assert proc.returncode == 0 and worker_env == {"MEGARL_TEST_KEEP": "1", "MEGARL_TEST_ADDED": "yes"}, out[-2000:]
    assert agent.go([], env) is None             # sent once

    held = HeldTorchrun.start(base)
    pid = held.proc.pid
    held.cancel()
    assert not psutil.pid_exists(pid)


def test_an_agent_that_ended_while_held_is_started_afresh():
    held = HeldTorchrun.start(dict(os.environ))
    held.proc.kill()
    held.proc.wait()
    assert held.go(["--help"], dict(os.environ)) is None
