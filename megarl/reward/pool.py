"""Score samples in parallel in a pool of Ray actors, each sample under a wall-clock limit.

One sample per actor at a time (megarl/parallel/actor_pool.py): an actor whose sample passes
`timeout_s` is killed and replaced, that sample scores as failed and is counted, and the other
samples carry on. Workers load the reward function themselves from its spec (path + name), so
functions defined in a user's file need not be picklable.
"""
from __future__ import annotations

from megarl.parallel.actor_pool import ActorPool, Job, PoolDeadline
from megarl.reward.loading import RewardFnSpec
from megarl.reward.scoring import Outcome, Sample, normalise

__all__ = ["PoolDeadline", "RayScoringPool"]


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
        spec.load()                               # a bad path/name/signature fails here, in one line
        self.spec, self.timeout_s = spec, timeout_s
        self.pool = ActorPool(_ScoreWorker, num_workers, (spec,))

    @property
    def replaced(self) -> int:
        return self.pool.replaced

    def score(self, samples: list[Sample], deadline: float | None = None) -> list[Outcome]:
        """Outcomes in order. Past `deadline` (time.monotonic()) the running samples' workers are
        killed and PoolDeadline says which samples ran how long (the manager names the slowest)."""
        done = self.pool.run([Job("score", (s.kwargs(),), self.timeout_s) for s in samples], deadline)
        out = []
        for d in done:
            if d.timed_out:
                out.append(Outcome(None, error=f"timed out after {self.timeout_s:g}s", timed_out=True))
            elif d.died is not None:              # the function killed its process (os._exit, segfault)
                out.append(Outcome(None, error=f"worker died: {d.died}"))
            else:
                score, info, err = d.value
                out.append(Outcome(score, info or {}, err))
        return out

    def close(self) -> None:
        self.pool.close()
