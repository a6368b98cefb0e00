"""Generation across rollout groups: each rollout-DP group generates its share of the prompts,
then every rank receives the whole rolled-out batch (the trainer's later passes each take their
own data-parallel slice from it).

    batch = generate(engine, prompts, sampling, ranks, pad_token_id)   # every rank, same prompts
"""
from __future__ import annotations

import numpy as np
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.rollout.base import SamplingParams
from megarl.rollout.sampling import step_seed

def sampling_seed(cfg) -> int:
    """The run's sampling seed: rollout.seed when set (verl's key for the engine's sampling), else
    trainer.seed. Both loops (colocated and the disaggregated rollout ranks) draw from it."""
    return cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed


def shard_rows(n: int, parts: int, index: int) -> np.ndarray:
    """Rows [start, stop) of part `index` when n rows are split as evenly as possible."""
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return np.arange(bounds[index], bounds[index + 1])


def generate(engine, prompts: DataProto, sampling: SamplingParams, ranks, pad_token_id: int) -> DataProto:
    """Prompts (the same on every rank) -> the full rolled-out batch on every rank, n rows per prompt."""
    mine = prompts[shard_rows(len(prompts), ranks.rollout_dp, ranks.rollout_dp_rank)]
    # Each group draws its own random stream: prompt indices restart at 0 in every group.
    mine.meta_info.update(sampling=sampling.with_(seed=step_seed(sampling.seed or 0, 0, ranks.rollout_dp_rank)),
                          pad_token_id=pad_token_id)
    out = engine.generate_sequences(mine) if len(mine) else None
    if ranks.world == 1:
        return out
    gathered: list = [None] * ranks.world
    dist.all_gather_object(gathered, out if ranks.rollout_tp_rank == 0 else None, group=ranks.group)
    parts = [g for g in gathered if g is not None]     # rank order = rollout-DP order
    batch = DataProto.concat(parts)
    batch.meta_info.pop("sampling", None)
    return batch


def broadcast_object(obj, src: int = 0):
    """`obj` from rank `src` on every rank (results computed once, e.g. rewards on rank 0)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
