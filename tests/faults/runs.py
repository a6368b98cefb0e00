"""Launching, pausing and killing real runs for the fault suite.

Every process of a launched run carries MEGARL_FAULT_TAG in its environment (torchrun, the
ranks and whatever they fork inherit it), so "no process of the run is left" is checked by
scanning every process on the machine, orphans re-parented to init included.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil

from megarl.parallel.lifecycle import RunDirLock
from megarl.config import ConfigError

TAG_ENV = "MEGARL_FAULT_TAG"


def overrides(model_dir, run_dir, steps=5, *extra):
    """The smallest sync run that saves, resumes and syncs: 2 ranks (actor TP 2), 8 prompts x 4."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=1e-3",
            "algorithm.filter_groups.enable=false", "trainer.plot_reward_curve=false", *extra]


def async_overrides(model_dir, run_dir, steps=5, *extra):
    """The disaggregated stream two batches ahead: rank 0 trains, ranks 1-2 generate (two rollout DP
    ranks, each half of every batch, in lock-step) in chunks of one token (responses span chunks),
    taking each update after the first chunk of the batch in flight (update_at_chunk:
    reproducible), the next batch starting once half of the one in flight is done (tail_overlap).
    The one-step schedule, with the trainer at TP 2, is tests/test_trainer_async.py's."""
    return overrides(model_dir, run_dir, steps, "trainer.n_gpus_per_node=3",
                     "actor_rollout_ref.rollout.placement=disaggregated",
                     "actor_rollout_ref.rollout.disaggregated_ranks=2",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "async_training.max_staleness=2",
                     "async_training.partial_rollout=true", "async_training.partial_chunk_tokens=1",
                     "async_training.update_at_chunk=1", "async_training.tail_overlap=0.5", *extra)


class Launch:
    """One launch: `python -m megarl.train` (megarl-train) or launch/torchrun.sh."""

    def __init__(self, args, fault: str | None = None, script: bool = False, env: dict | None = None):
        self.tag = uuid.uuid4().hex
        self.fault_dir = f"/tmp/megarl-fault-{self.tag}"
        os.makedirs(self.fault_dir)
        full = {**os.environ, TAG_ENV: self.tag, "MEGARL_FAULT_DIR": self.fault_dir, **(env or {})}
        full.pop("MEGARL_FAULT", None)
        if fault:
            full["MEGARL_FAULT"] = fault
        if script:
            full["PYTHON"] = sys.executable
            cmd = ["bash", "launch/torchrun.sh", "configs/quickstart.yaml", *args]
        else:
            cmd = [sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml", *args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full, start_new_session=True)
        self.out = ""

    @property
    def marker(self) -> str:
        return os.path.join(self.fault_dir, "reached")

    def wait_paused(self, timeout=300) -> int:
        """Wait until a rank is parked at the fault point; returns its pid."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.marker):
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (rc {self.proc.returncode}) before the fault point:\n"
                                     + self.finish()[1][-3000:])
            assert time.monotonic() < deadline, "fault point not reached"
            time.sleep(0.05)
        return int(open(self.marker).read().split(":")[3])

    def finish(self, timeout=600) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        self.out += out or ""
        return self.proc.returncode, self.out

    def kill_group(self) -> None:
        """SIGKILL every process of the run at once, as a scheduler's job kill does."""
        for p in run_processes(self.tag):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.finish(timeout=60)

    def left_after(self, seconds: float) -> list:
        """Processes of this run still alive `seconds` after now (polled; returns early when none)."""
        deadline = time.monotonic() + seconds
        while True:
            left = run_processes(self.tag)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def run_processes(tag: str) -> list:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def lock_is_free(run_dir) -> bool:
    try:
        lock = RunDirLock(str(run_dir)).acquire()
    except ConfigError:
        return False
    lock.release()
    return True


def run(args, **kw) -> tuple[int, str]:
    return Launch(args, **kw).finish()
