"""Held-out evaluation: the whole validation set with `rollout.val_kwargs` sampling (greedy by
default), scored by the same reward as training.

    val/accuracy          mean of the reward's `acc` field (else: score > 0)
    val/score/mean        mean score; val/<data_source>/accuracy per source when there are several
    val/response_length/mean
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from megarl.data.loader import collate
from megarl.protocol import DataProto
from megarl.trainer.generation import broadcast_object, generate


def _val_batches(loader):
    size = loader.sampler.batch_size
    for batch_no, start in enumerate(range(0, len(loader.dataset), size)):
        rows = range(start, min(start + size, len(loader.dataset)))
        yield collate([loader.dataset[i] for i in rows], 0, batch_no, split="val")


def validate(parts, ranks, sampling) -> dict:
    scores, accs, sources, lengths = [], [], [], []
    for prompts in _val_batches(parts.val_loader):
        out: DataProto = generate(parts.rollout, prompts, sampling, ranks, parts.pad_token_id)
        if parts.reward is None:
            continue
        result = parts.reward(out)          # rank 0 only: every rank has the same batch
        seq_scores = result.token_level_scores.sum(-1).tolist()
        scores += seq_scores
        acc = result.extra_info.get("acc")
        accs += [float(a) for a in acc] if acc is not None else [float(s > 0) for s in seq_scores]
        sources += [str(s) for s in out.non_tensor_batch.get("data_source", [None] * len(out))]
        lengths += out.batch["response_lens"].tolist()
    metrics = _summarise(scores, accs, sources, lengths) if parts.reward is not None else None
    return broadcast_object(metrics) or {}


def _summarise(scores, accs, sources, lengths) -> dict:
    if not scores:
        return {}
    out = {"val/accuracy": float(np.mean(accs)), "val/score/mean": float(np.mean(scores)),
           "val/response_length/mean": float(np.mean(lengths)), "val/samples": len(scores)}
    by_source = defaultdict(list)
    for src, acc in zip(sources, accs):
        by_source[src].append(acc)
    if len(by_source) > 1:
        out.update({f"val/{src}/accuracy": float(np.mean(v)) for src, v in by_source.items()})
    return out
