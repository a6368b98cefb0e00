"""Validation metrics under verl's names (verl 0.9.1, RayPPOTrainer._val_metrics_update over
process_validation_metrics), for every data source, one included:

    val-core/<data_source>/<acc or reward>/mean@N     (and best@N, maj@N: N the responses per prompt)
    val-aux/<data_source>/<var>/{mean,std}@N, best@n/{mean,std}, worst@n/..., maj@n/...

<var> is `reward` (summed token scores) and every numeric key of the reward's extra info; `acc` is
the core variable when the reward gives one (verl records a number returned as acc). best/worst/maj
at n are bootstrap estimates over 1000 draws of n of the prompt's N responses (seed 42), then
averaged over prompts; maj needs a `pred` key.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000


def _subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below n, then n itself (nothing for a single response)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _bootstrap(data: list, size: int, reducers: list, seed: int) -> list[tuple[float, float]]:
    """(mean, std) of each reducer over N_BOOTSTRAP draws of `size` items with replacement. The
    draws come from a RandomState(seed): the stream verl draws from np.random.seed(seed)."""
    items = np.array(data, dtype=object)
    draws = np.random.RandomState(seed).choice(len(items), size=(N_BOOTSTRAP, size), replace=True)
    out = []
    for reduce in reducers:
        values = np.array([reduce(items[row]) for row in draws], dtype=np.float64)
        out.append((float(values.mean()), float(values.std())))
    return out


def _majority(votes) -> float:
    """The value of the first sample of the most common prediction (ties: the first seen)."""
    by_pred: dict[Any, list] = defaultdict(list)
    for vote in votes:
        by_pred[vote[0]].append(vote[1])
    return max(by_pred.items(), key=lambda kv: len(kv[1]))[1][0]


def _one_prompt(values: list, preds: list | None, seed: int) -> dict[str, float]:
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for size in _subset_sizes(n):
        (best, best_sd), (worst, worst_sd) = _bootstrap(values, size, [np.max, np.min], seed)
        out.update({f"best@{size}/mean": best, f"best@{size}/std": best_sd,
                    f"worst@{size}/mean": worst, f"worst@{size}/std": worst_sd})
        if preds is not None:
            votes = [(p, v) for p, v in zip(preds, values)]
            [(maj, maj_sd)] = _bootstrap(votes, size, [_majority], seed)
            out.update({f"maj@{size}/mean": maj, f"maj@{size}/std": maj_sd})
    return out


def by_source(sources: list, uids: list, variables: dict[str, list], seed: int = 42) -> dict:
    """{data_source: {variable: {metric: value}}}: per prompt (uid) first, then the mean over prompts."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(sources, uids)):
        for name, values in variables.items():
            grouped[source][uid][name].append(values[i])
    result: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, prompts in grouped.items():
        for per_var in prompts.values():
            preds = per_var.get("pred")
            for name, raw in per_var.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):     # text (pred itself) is not averaged
                    continue
                usable = preds if preds is not None and len(preds) == len(values) and None not in preds else None
                for metric, value in _one_prompt(values, usable, seed).items():
                    result[source][name][metric].append(value)
    return {src: {name: {m: float(np.mean(v)) for m, v in metrics.items()} for name, metrics in per.items()}
            for src, per in result.items()}


def verl_val_metrics(sources: list, uids: list, scores: list[float], extra: dict[str, list]) -> dict[str, float]:
    """val-core / val-aux metrics of one validation: `scores` summed per sample, `extra` the reward's
    extra info columns (verl's reward_extra_infos_dict without its `reward`, which is `scores`)."""
    table = by_source(sources, uids, {"reward": scores, **extra})
    out = {}
    for source, per_var in table.items():
        core = "acc" if "acc" in per_var else "reward"
        for name, metrics in per_var.items():
            n_max = max(int(m.split("@")[-1].split("/")[0]) for m in metrics)
            for metric, value in metrics.items():
                is_core = name == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = value
    return out
