"""A pool of Ray actors that runs jobs one per actor, each under its own time limit.

    pool = ActorPool(MyActor, num_actors=4, init_args=(spec,))
    done = pool.run([Job("score", (kwargs,), timeout_s=10.0), ...], deadline=time.monotonic() + 60)
    for d in done: d.value / d.timed_out / d.died        # in job order
    pool.close()

One job per actor at a time, so a job's clock starts when it starts running. An actor whose job
passes its time limit is killed and replaced (`replaced` counts them): that job comes back
timed out and the other jobs carry on. A job whose actor dies (os._exit, a segfault) comes back
with `died` set and the actor is replaced too. Past `deadline` (time.monotonic()), the running
jobs' actors are killed and replaced, and PoolDeadline says which jobs ran how long. The reward
pool (megarl/reward/pool.py) and the Ray tool backend (megarl/rollout/multiturn/executor.py) run
on it. Actors need a `ready()` method (the pool waits for it before giving them work).
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from megarl.parallel.ray_auth import private_temp_dir, ray_token_auth


@dataclass(frozen=True)
class Job:
    method: str
    args: tuple
    timeout_s: float


@dataclass
class Done:
    value: Any = None
    seconds: float = 0.0
    timed_out: bool = False
    died: str | None = None                # the first line of Ray's error when the actor died


class PoolDeadline(Exception):
    """The batch deadline passed: `done` jobs had finished; `seconds` per started job (`running`:
    the ones cut off)."""

    def __init__(self, done: int, seconds: dict[int, float], running: set[int]):
        super().__init__(f"deadline passed with {done} jobs done")
        self.done, self.seconds, self.running = done, seconds, running


_SHARED: set[str] = set()   # addresses of the Ray clusters megarl started or joined for a job's ranks


def share_ray(address: str) -> str:
    """Mark the cluster this process is attached to as megarl's (TensorRT-LLM's node cluster:
    megarl's token, outlives every LLM), so a pool in this process runs there. Returns `address`."""
    _SHARED.add(address)
    return address


def ensure_ray(num_cpus: int) -> None:
    """Start a local Ray if none is running (tests and single-node runs); reuse one otherwise.
    A Ray started here requires a token (parallel/ray_auth.py)."""
    import ray  # optional at run time: loads (about a second) only when a pool is asked for
    if ray.is_initialized():
        # With TLLM_RAY_FORCE_LOCAL_CLUSTER=1 TensorRT-LLM's executor starts Ray in this process
        # (namespace "trtllm", no token) and ray.shutdown()s it with its LLM: a pool there would run
        # unauthenticated and die with it. The job's node cluster (share_ray) is megarl's own.
        context = ray.get_runtime_context()
        if context.namespace == "trtllm" and context.gcs_address not in _SHARED:
            raise RuntimeError("Ray in this process belongs to TensorRT-LLM's rollout engine, which shuts it down "
                               "with the LLM and runs it without megarl's token (TLLM_RAY_FORCE_LOCAL_CLUSTER=1): "
                               "unset that variable, or set reward_model.launch_reward_fn_async=false and "
                               "actor_rollout_ref.rollout.multi_turn.tool_backend=thread")
        return
    warning = ray_token_auth()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # Workers must import megarl and the user's modules as the driver does.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    # _temp_dir is ray.init's documented keyword for the sessions' root (Ray 2.60's worker.py)
    ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, _temp_dir=private_temp_dir(),
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}})


class ActorPool:
    def __init__(self, actor_cls: type, num_actors: int, init_args: tuple = ()):
        import ray  # optional at run time: see ensure_ray
        self._ray = ray
        ensure_ray(max(num_actors, 1))
        # num_cpus=0: the pool size alone bounds concurrency, and a pool larger than Ray's CPU
        # count still starts instead of waiting for resources.
        self._cls, self._init_args = ray.remote(num_cpus=0, max_restarts=0)(actor_cls), init_args
        self.actors = [self._spawn() for _ in range(num_actors)]
        ray.get([a.ready.remote() for a in self.actors])
        self.replaced = 0

    def _spawn(self):
        return self._cls.remote(*self._init_args)

    def run(self, jobs: list[Job], deadline: float | None = None) -> list[Done]:
        """Every job's Done, in order; raises PoolDeadline past `deadline` (the pool stays whole)."""
        ray = self._ray
        out: list[Done | None] = [None] * len(jobs)
        seconds: dict[int, float] = {}
        pending, idle = deque(range(len(jobs))), list(range(len(self.actors)))
        running: dict = {}                        # ref -> (actor, job, start)
        starting: dict = {}                       # ready ref of a replacement actor -> actor
        while pending or running:
            while idle and pending:
                w, i = idle.pop(), pending.popleft()
                job = jobs[i]
                running[getattr(self.actors[w], job.method).remote(*job.args)] = (w, i, time.monotonic())
            now = time.monotonic()
            wait = max(0.0, min(s + jobs[i].timeout_s for _, i, s in running.values()) - now) if running else None
            if deadline is not None:
                if now >= deadline:
                    late = {i: now - start for _, i, start in running.values()}
                    for w, _, _ in running.values():
                        self._kill_and_replace(w, starting)
                    raise PoolDeadline(sum(d is not None for d in out), {**seconds, **late}, set(late))
                wait = deadline - now if wait is None else min(wait, deadline - now)
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=wait)
            for ref in ready:
                if ref in starting:
                    idle.append(starting.pop(ref))
                    continue
                w, i, start = running.pop(ref)
                seconds[i] = time.monotonic() - start
                try:
                    out[i] = Done(ray.get(ref), seconds[i])
                    idle.append(w)
                except ray.exceptions.RayActorError as err:   # the job killed its process
                    out[i] = Done(seconds=seconds[i], died=str(err).splitlines()[0])
                    self._replace(w, starting)
            now = time.monotonic()
            for ref, (w, i, start) in list(running.items()):
                if now - start >= jobs[i].timeout_s:
                    running.pop(ref)
                    out[i] = Done(seconds=now - start, timed_out=True)
                    self._kill_and_replace(w, starting)
        if starting:                              # keep the pool whole for the next batch
            ray.get(list(starting))
        return out  # type: ignore[return-value]

    def _kill_and_replace(self, w: int, starting: dict) -> None:
        self._ray.kill(self.actors[w], no_restart=True)
        self._replace(w, starting)

    def _replace(self, w: int, starting: dict) -> None:
        self.actors[w] = self._spawn()
        self.replaced += 1
        starting[self.actors[w].ready.remote()] = w

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a, no_restart=True)
        self.actors = []
