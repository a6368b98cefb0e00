"""Score samples in parallel in a pool of Ray actors, each sample under a wall-clock limit.

One sample per actor at a time, so a sample's clock starts when it starts running. An actor
whose sample passes `timeout_s` is killed and replaced: that sample scores as failed and is
counted, and the other samples carry on. Workers load the reward function themselves from its
spec (path + name), so functions defined in a user's file need not be picklable.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque

from megarl.parallel.ray_auth import ray_token_auth
from megarl.reward.loading import RewardFnSpec
from megarl.reward.scoring import Outcome, Sample, normalise


def ensure_ray(num_cpus: int) -> None:
    """Start a local Ray if none is running (tests and single-node runs); reuse one otherwise.
    A Ray started here requires a token (ray_token_auth)."""
    import ray
    if ray.is_initialized():
        return
    warning = ray_token_auth()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # Workers must import megarl and the user's modules as the driver does.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}})


class _ScoreWorker:
    def __init__(self, spec: RewardFnSpec):
        self.fn, self.kwargs = spec.load(), dict(spec.kwargs)

    def ready(self) -> bool:
        return True

    def score(self, kwargs: dict) -> tuple:
        try:
            score, info = normalise(self.fn(**kwargs, **self.kwargs))
            return score, info, None
        except Exception as err:  # contained and reported; the actor stays usable
            return None, {}, f"{type(err).__name__}: {err}"


class RayScoringPool:
    def __init__(self, spec: RewardFnSpec, num_workers: int, timeout_s: float):
        import ray
        ensure_ray(max(num_workers, 1))
        spec.load()                               # a bad path/name/signature fails here, in one line
        self.spec, self.timeout_s = spec, timeout_s
        # num_cpus=0: the pool size alone bounds concurrency, and a pool larger than Ray's CPU
        # count still starts instead of waiting for resources.
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0)(_ScoreWorker)
        self.workers = [self._spawn() for _ in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])
        self.replaced = 0

    def _spawn(self):
        return self._actor_cls.remote(self.spec)

    def score(self, samples: list[Sample], deadline: float | None = None, scorer: str = "the reward function") -> list[Outcome]:
        """Outcomes in order. Past `deadline` (time.monotonic()) the running samples' workers are
        killed and RewardDeadline names the slowest samples."""
        import ray
        from ray.exceptions import RayActorError

        from megarl.reward.manager import deadline_error, slowest_samples
        begin = time.monotonic()
        seconds: dict[int, float] = {}
        out: list[Outcome | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        idle = list(range(len(self.workers)))
        running: dict = {}                        # ref -> (worker, sample, start)
        starting: dict = {}                       # ready ref of a replacement actor -> worker
        while pending or running:
            while idle and pending:
                w, i = idle.pop(), pending.popleft()
                running[self.workers[w].score.remote(samples[i].kwargs())] = (w, i, time.monotonic())
            now = time.monotonic()
            wait = max(0.0, min(s + self.timeout_s for _, _, s in running.values()) - now) if running else None
            if deadline is not None:
                if now >= deadline:
                    late = {i: now - start for _, i, start in running.values()}
                    for w, _, _ in running.values():   # the pool stays whole for whoever handles the error
                        ray.kill(self.workers[w], no_restart=True)
                        self._replace(w, starting)
                    done = sum(o is not None for o in out)
                    raise deadline_error(scorer, deadline - begin, len(samples), done,
                                         slowest_samples(samples, {**seconds, **late}, set(late)))
                wait = deadline - now if wait is None else min(wait, deadline - now)
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=wait)
            for ref in ready:
                if ref in starting:
                    idle.append(starting.pop(ref))
                    continue
                w, i, start = running.pop(ref)
                seconds[i] = time.monotonic() - start
                try:
                    score, info, err = ray.get(ref)
                    out[i] = Outcome(score, info or {}, err)
                    idle.append(w)
                except RayActorError as err:      # the function killed its process (os._exit, segfault)
                    out[i] = Outcome(None, error=f"worker died: {str(err).splitlines()[0]}")
                    self._replace(w, starting)
            now = time.monotonic()
            for ref, (w, i, start) in list(running.items()):
                if now - start >= self.timeout_s:
                    running.pop(ref)
                    out[i] = Outcome(None, error=f"timed out after {self.timeout_s:g}s", timed_out=True)
                    ray.kill(self.workers[w], no_restart=True)
                    self._replace(w, starting)
        if starting:                              # keep the pool whole for the next batch
            ray.get(list(starting))
        return out  # type: ignore[return-value]

    def _replace(self, w: int, starting: dict) -> None:
        self.workers[w] = self._spawn()
        self.replaced += 1
        starting[self.workers[w].ready.remote()] = w

    def close(self) -> None:
        import ray
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
