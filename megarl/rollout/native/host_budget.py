"""On CPU, what one rank may hold: its share of the host's memory, and the check that a run fits it.

    share = rank_share_bytes()            # host memory (cgroup limit if lower) / local ranks
    check_fits(engine, prompt_len=512, gen_len=1024, n=8, bucket_bytes=512 << 20)   # at build

Several ranks share one host's memory on CPU (and the trainer's actor lives in the same process
as the engine), so nothing a rank allocates may be sized from "whatever is free": the native
engine's KV cache budget is `gpu_memory_utilization` of this rank's share minus what the process
already holds (the GPU rule, with the share in place of the device), or `kv_cache_gb` when set;
the sync's two bucket buffers come from `checkpoint_engine.bucket_size_mb` (at most the model). `check_fits` runs when
the engine is built, before any step: if the engine's weights, the smallest KV cache a call needs
(n rows of prompt + response tokens) and two bucket buffers do not fit on top of what the process
holds, it raises one ConfigError naming the key to change.
"""
from __future__ import annotations

import os

import psutil

from megarl.config.errors import ConfigError

_KEY = "actor_rollout_ref.rollout"
KV_KEY = f"{_KEY}.engine_kwargs.native.kv_cache_gb"
GiB = 2**30


def _meminfo_total() -> int | None:
    try:
        return psutil.virtual_memory().total
    except (OSError, RuntimeError):
        return None


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:     # "max" or a huge number: no limit
            return int(text)
    return None


def host_memory_bytes() -> int | None:
    """The host's memory, or the container's limit where lower; None where neither is readable."""
    got = [b for b in (_meminfo_total(), _cgroup_limit()) if b]
    return min(got) if got else None


def local_ranks() -> int:
    """Ranks of this job on this host (LOCAL_WORLD_SIZE as torchrun and launch/slurm set it)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1))


def rank_share_bytes() -> int | None:
    host = host_memory_bytes()
    return None if host is None else host // local_ranks()


def resident_bytes() -> int:
    """This process's resident set now."""
    return psutil.Process().memory_info().rss


def size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB / 10 else f"{b / 2**20:.1f} MiB"


def describe_share() -> str:
    return f"{size(host_memory_bytes() or 0)} host memory / {local_ranks()} local rank(s)"


def check_fits(engine, prompt_len: int, gen_len: int, n: int, bucket_bytes: int = 0,
               held_before: int | None = None) -> None:
    """Raise ConfigError (one line, the key to change) if the smallest working set of a generate
    call does not fit this rank's budget. `held_before`: the process's resident bytes before the
    engine allocated its weights (default: now)."""
    weights = sum(p.numel() * p.element_size() for p in engine.params.values())
    per_row, per_group = engine.row_costs(prompt_len, gen_len)
    kv_min = n * per_row + per_group
    need = f"n={n} rows of {prompt_len}+{gen_len} tokens need {size(kv_min)} of KV cache"
    if engine.kv_cache_gb is not None:
        if kv_min > engine.kv_cache_gb * GiB:
            raise ConfigError(f"{need}, more than kv_cache_gb={engine.kv_cache_gb:g}; raise it, or lower "
                              "rollout.n / prompt_length / response_length", KV_KEY)
        kv = engine.kv_cache_gb * GiB
    else:
        kv = kv_min
    share = rank_share_bytes()
    if share is None:
        return
    held = resident_bytes() if held_before is None else held_before
    buckets = 2 * min(bucket_bytes, weights * engine.comm.size)   # a bucket never holds more than the model
    total = held + weights + kv + buckets
    limit = share if engine.kv_cache_gb is not None else engine.gpu_memory_utilization * share
    if total > limit:
        parts = (f"this rank holds {size(held)}, the engine's weights {size(weights)}, {need}"
                 f"{' (kv_cache_gb)' if engine.kv_cache_gb is not None else ''}, two sync buckets "
                 f"{size(buckets)}: {size(total)}")
        if engine.kv_cache_gb is not None:
            raise ConfigError(f"{parts}, more than this rank's share ({size(share)} = {describe_share()}); "
                              "lower kv_cache_gb (or run fewer ranks per host)", KV_KEY)
        raise ConfigError(f"{parts}, more than gpu_memory_utilization={engine.gpu_memory_utilization:g} of this rank's "
                          f"share ({size(share)} = {describe_share()}); raise it (on CPU it is the share of "
                          "host memory a rank may fill), or lower rollout.n / response_length / "
                          "checkpoint_engine.bucket_size_mb", f"{_KEY}.gpu_memory_utilization")


def cpu_budget_bytes(utilization: float, held: int) -> float | None:
    """The KV cache and row budget of an engine on CPU: `utilization` of this rank's share, minus
    the process's resident set, plus what the engine's cache and rows already hold (`held`)."""
    share = rank_share_bytes()
    return None if share is None else utilization * share - resident_bytes() + held


def too_small(engine, n: int, prompt_len: int, gen_len: int, need: float, budget: float) -> ConfigError:
    """The error of a generate call whose smallest KV cache (n rows, one prompt) exceeds the budget."""
    what = f"n={n} rows of {prompt_len}+{gen_len} tokens need {size(need)} of KV cache, but this rank's budget"
    if engine.kv_cache_gb is not None:
        return ConfigError(f"{what} is kv_cache_gb={engine.kv_cache_gb:g}; raise it", KV_KEY)
    return ConfigError(f"{what} has {size(max(budget, 0))} left (gpu_memory_utilization="
                       f"{engine.gpu_memory_utilization:g} of {describe_share()}, minus what the process holds); "
                       "raise gpu_memory_utilization or set engine_kwargs.native.kv_cache_gb",
                       f"{_KEY}.gpu_memory_utilization")
