"""python -m megarl.launcher.vars: the pairs launch/slurm/job.sh reads back through srun, and the
line about the last save that a Slurm restart prints beside the stop signal's margin."""
import json
import os
import subprocess
import sys

from megarl.experiment import load_config
from megarl.launcher.vars import stop_margin_lines

PRINTING_REWARD = '''import os
print("MEGARL_RUN_DIR=/planted")
os.write(1, b"MEGARL_PLANTED\\0/from/c\\0")


def score(data_source, solution_str, ground_truth, extra_info=None):
    os.write(1, b"scored\\n")
    return float(solution_str.strip() == str(ground_truth).strip())
'''


def test_env_file_stdout_holds_only_the_pairs(addition_model_dir, tmp_path):
    reward = tmp_path / "printing_reward.py"
    reward.write_text(PRINTING_REWARD)
    got = subprocess.run([sys.executable, "-m", "megarl.launcher.vars", "--env-file", "-", "--free-port",
                          "--config", "configs/quickstart.yaml", f"actor_rollout_ref.model.path={addition_model_dir}",
                          f"trainer.default_local_dir={tmp_path / 'run'}", f"custom_reward_function.path={reward}",
                          "custom_reward_function.name=score", "algorithm.filter_groups.enable=false"],
                         capture_output=True, timeout=300)
    assert got.returncode == 0, got.stderr.decode()[-3000:]
    fields = got.stdout.split(b"\0")
    assert fields[-1] == b""
    pairs = dict(zip(fields[:-1:2], fields[1::2]))
    assert all(k.startswith(b"MEGARL_") for k in pairs) and b"MEGARL_PLANTED" not in pairs, got.stdout
    assert pairs[b"MEGARL_RUN_DIR"] == str(tmp_path / "run").encode()
    assert 0 < int(pairs[b"MEGARL_FREE_PORT"]) < 65536
    # What the user's module wrote to stdout, from Python or below it, went to stderr.
    assert b"MEGARL_RUN_DIR=/planted" in got.stderr and b"MEGARL_PLANTED\0/from/c" in got.stderr


def test_stop_margin_line_names_the_last_save_and_warns_when_it_does_not_fit(tmp_path):
    cfg = load_config("configs/quickstart.yaml", [f"trainer.default_local_dir={tmp_path}"])
    assert stop_margin_lines(cfg, 600) == [
        "megarl: the stop signal comes 600 s before the time limit (MEGARL_SIGNAL_MARGIN_S, sbatch "
        f"--signal=B:USR1@600); {tmp_path}/metrics.jsonl records no save yet"]
    records = [{"step": 4, "timing_s/step": 90.0, "timing_s/save_checkpoint": 300.5},
               {"step": 5, "timing_s/step": 95.0}]
    with open(os.path.join(tmp_path, "metrics.jsonl"), "w") as f:
        f.write('{"step": 3, "timing_s/save_ch')            # torn
        f.write("\n" + "\n".join(json.dumps(r) for r in records) + "\n")
    lines = stop_margin_lines(cfg, 600)
    assert len(lines) == 1 and lines[0].endswith(
        f"; the last save took 300.5 s and a step 90.0 s (step 4 in {tmp_path}/metrics.jsonl)")
    lines = stop_margin_lines(cfg, 300)
    assert len(lines) == 2 and lines[1].startswith("megarl: warning: a step plus a save (390 s) does not fit the "
                                                   "300 s margin")
    slow = load_config("configs/quickstart.yaml", [f"trainer.default_local_dir={tmp_path}", "trainer.stop_grace_s=60"])
    assert len(stop_margin_lines(slow, 600)) == 2          # the step alone outlasts trainer.stop_grace_s
