"""What every transport shares: the all-or-nothing ending of a sync, and its metrics.

A sync streams buckets into engines that load in place. If any rank fails part-way, every rank
aborts the update and raises WeightSyncError, so no engine ever runs on a mix of old and new
weights: each engine then keeps its old weights or refuses to generate until a full sync
succeeds, as its class declares (`keeps_weights_on_failed_sync`; the message says which).
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from megarl.checkpoint_engine.errors import WeightSyncError
from megarl.parallel.bridge import Bridge
from megarl.rollout.base import RolloutEngine


def describe(err: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(err), err)).strip()


def agree(failed: bool, values: list[float], group=None, device="cpu") -> tuple[bool, list[float]]:
    """One all-reduce (MAX) over `group`: did any rank fail, and the largest of each value."""
    t = torch.tensor([float(failed), *values], dtype=torch.float64, device=device)
    if isinstance(group, Bridge):        # spans both sides of a disaggregated job (on its own device)
        t = t.to(group.device)
        group.all_reduce(t, op=dist.ReduceOp.MAX)
    elif dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = t.tolist()
    return out[0] > 0, out[1:]


def after_failure(engine: RolloutEngine | None) -> str:
    """What the engine in use keeps after a failed sync, as its class declares it."""
    if engine is not None and not engine.keeps_weights_on_failed_sync:
        return ("refuses to generate until a full sync succeeds (it rewrites its weights from a sync's first "
                "bucket on)")
    return "keeps its old weights or refuses to generate until a full sync succeeds"


def conclude(engine: RolloutEngine | None, error: BaseException | None, values: list[float], group=None,
             device="cpu") -> list[float]:
    """Finalize every engine if every rank succeeded, else abort every engine and raise."""
    failed, values = agree(error is not None, values, group, device)
    if failed:
        if engine is not None:
            engine.abort_weight_update()
        where = f"on this rank: {describe(error)}" if error is not None else "on another rank (see its log)"
        raise WeightSyncError(f"weight sync failed {where}; the update was aborted on every rank, and the rollout "
                              f"engine {after_failure(engine)}")
    if engine is not None:
        engine.finalize_weights()
    return values


def metrics(seconds: float, model_bytes: int, buckets: int, peak_extra_mb: float, wire_bytes: float) -> dict:
    return {"weight_sync/seconds": seconds, "weight_sync/gb": model_bytes / 1e9,
            "weight_sync/gb_per_s": model_bytes / 1e9 / max(seconds, 1e-9), "weight_sync/buckets": float(buckets),
            "weight_sync/peak_extra_mb": peak_extra_mb, "weight_sync/wire_gb": wire_bytes / 1e9}
