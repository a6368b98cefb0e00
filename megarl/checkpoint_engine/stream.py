"""From a bucket's buffer to the engine's (HF name, tensor) stream, and into the engine.

    feed(engine, bucket_stream(plan, bucket, buf, tp_rank, own_shards, want), shards=True)

Pure tensor code shared by every transport. Gathered entries become full HF tensors
(convert.megatron_to_hf); local entries are split into the HF pieces their shard holds. An
engine that takes shards gets a view of its part of each; others get the full tensors. The
stream is a generator, so at most one megatron tensor's conversion is alive at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from megarl.checkpoint_engine.plan import Bucket, TransferPlan, gathered_to_hf, narrow_to, split_shard
from megarl.rollout.base import RolloutEngine, ShardSlice


def takes_shards(engine: RolloutEngine, name: str = "model.embed_tokens.weight") -> Callable[[str], ShardSlice] | None:
    """engine.weight_shard when the engine accepts pre-sharded input (a ShardSlice for the
    model's tensors), else None: it takes full tensors."""
    probe = getattr(engine, "weight_shard", None)
    if probe is None or probe(name) is None:
        return None
    return probe


def entry_shards(plan: TransferPlan, bucket: Bucket, buf: torch.Tensor | None, entry, tp_rank: int,
                 own: Mapping[str, torch.Tensor] | None) -> list[torch.Tensor]:
    """The shards of `entry`: all TP ranks' for a gathered entry, else this rank's own. `own`
    (the parameters, on the ranks of the bucket's stage) supplies this rank's shards; the rest
    come from the buffer."""
    G = bucket.gather_numel
    if entry.gather:
        return [own[entry.name] if own is not None and t == tp_rank else
                buf[t * G + entry.offset: t * G + entry.offset + entry.numel].view(entry.shape)
                for t in range(plan.tp)]
    if own is not None:
        return [own[entry.name]]
    start = plan.tp * G + entry.offset
    return [buf[start: start + entry.numel].view(entry.shape)]


def bucket_stream(plan: TransferPlan, bucket: Bucket, buf: torch.Tensor | None, tp_rank: int,
                  own: Mapping[str, torch.Tensor] | None = None,
                  want: Callable[[str], ShardSlice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every HF tensor of `bucket`: full tensors, or with `want` (an
    engine's weight_shard) this rank's part of each. A gathered entry alone in the bucket must
    have every slot filled (own included): the buffer is then read as the full tensor."""
    for entry in bucket.entries:
        shards = entry_shards(plan, bucket, buf, entry, tp_rank, own)
        if entry.gather:
            alone = bucket.gather_numel == entry.numel      # rank-major layout = the concatenation
            joined = buf[:plan.tp * entry.numel] if alone else None
            pieces = gathered_to_hf(entry.name, shards, plan.spec, plan.head, joined)
        else:
            pieces = split_shard(entry.name, shards[0], plan.spec, tp_rank, plan.tp, plan.head)
        for outer, t in pieces:
            yield outer.hf_name, (t if want is None else narrow_to(t, outer, want(outer.hf_name)))


def feed(engine: RolloutEngine, stream, shards: bool) -> None:
    """One engine call per bucket: update_weight_shards for shard-taking engines, else update_weights."""
    if shards:
        engine.update_weight_shards(stream)
    else:
        engine.update_weights(stream)
