"""Whole training runs as users start them (`python -m megarl.train`), for the end-to-end tests
(tests/test_trainer_e2e.py, test_trainer_async.py, test_parallel_trainer.py, gpu/test_gpu.py)."""
import hashlib
import os
import re
import signal
import subprocess
import sys

import psutil

# clocks and memory readings differ between any two runs
VOLATILE = re.compile(r"^(time|timing_s/|timing_per_token_ms/"
                      r"|perf/(throughput|time_per_step|mfu/|max_memory_|cpu_memory_)|reward/latency_s"
                      r"|weight_sync/(seconds|gb_per_s|peak_extra_mb)|memory/|async/(engine_idle_fraction|buffer_ready))")


def overrides(model_dir, run_dir, *extra):
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=6", "trainer.save_freq=2", "trainer.test_freq=3",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.optim.lr=1e-4", "trainer.max_actor_ckpt_to_keep=2",
            "algorithm.filter_groups.enable=false", *extra]


def train(args, **popen):
    cmd = [sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def kill_tree(proc):
    """SIGKILL the launcher and every rank, as a scheduler's job kill does (torchrun starts its
    workers in sessions of their own, so a process-group kill would miss them)."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs, timeout=30)


def stable(record):
    return {k: v for k, v in record.items() if not VOLATILE.match(k)}


def step_digests(step_dir) -> dict[str, str]:
    """SHA-256 of each `.distcp` file of a step's actor (weights and optimizer state, byte for byte)."""
    actor = os.path.join(step_dir, "actor")
    return {name: hashlib.sha256(open(os.path.join(actor, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(actor)) if name.endswith(".distcp")}
