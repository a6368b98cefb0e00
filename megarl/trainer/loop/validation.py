"""Held-out evaluation: the whole validation set with `rollout.val_kwargs` sampling (greedy by
default), scored by the same reward as training.

    val/accuracy          mean of the reward's `acc` field (else: score > 0)
    val/score/mean        mean score; val/<data_source>/accuracy per source (one source too)
    val/response_length/mean
    val-core/*, val-aux/* verl's names for the same validation (megarl/trainer/metrics/validation.py)

The scoring rank writes trainer.validation_data_dir/<step>.jsonl and picks log_val_generations'
samples (megarl/trainer/metrics/generations.py).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from megarl.data.loader import collate
from megarl.protocol import DataProto
from megarl.trainer.loop.generation import broadcast_object, generate
from megarl.trainer.metrics.generations import Generations, decode, dump_validation
from megarl.trainer.metrics.validation import verl_val_metrics


def _val_batches(loader):
    size = loader.sampler.batch_size
    for batch_no, start in enumerate(range(0, len(loader.dataset), size)):
        rows = range(start, min(start + size, len(loader.dataset)))
        yield collate([loader.dataset[i] for i in rows], 0, batch_no, split="val")


def validate(parts, ranks, sampling, trainer_cfg, step: int) -> dict:
    scores, accs, sources, lengths, uids = [], [], [], [], []
    gen = Generations()
    for prompts in _val_batches(parts.val_loader):
        out: DataProto = generate(parts.rollout, prompts, sampling, ranks, parts.pad_token_id)
        if parts.reward is None:
            continue
        result = parts.reward(out)          # rank 0 only: every rank has the same batch
        result.apply(out)
        seq_scores = result.token_level_scores.sum(-1).tolist()
        scores += seq_scores
        acc = result.extra_info.get("acc")
        accs += [float(a) for a in acc] if acc is not None else [float(s > 0) for s in seq_scores]
        # verl names a row without a data_source "unknown"
        sources += [str(s) for s in out.non_tensor_batch.get("data_source", ["unknown"] * len(out))]
        uids += list(out.non_tensor_batch["uid"])
        lengths += out.batch["response_lens"].tolist()
        gen.extend(decode(out, parts.tokenizer, result.reward_extra_info))
    metrics = None
    if parts.reward is not None and scores:
        metrics = {**_summarise(scores, accs, sources, lengths), **verl_val_metrics(sources, uids, scores, gen.extra),
                   **dump_validation(trainer_cfg, step, gen)}
    return broadcast_object(metrics) or {}


def _summarise(scores, accs, sources, lengths) -> dict:
    if not scores:
        return {}
    out = {"val/accuracy": float(np.mean(accs)), "val/score/mean": float(np.mean(scores)),
           "val/response_length/mean": float(np.mean(lengths)), "val/samples": len(scores)}
    by_source = defaultdict(list)
    for src, acc in zip(sources, accs):
        by_source[src].append(acc)
    out.update({f"val/{src}/accuracy": float(np.mean(v)) for src, v in by_source.items()})
    return out
