"""DAPO's batch shaping: dynamic sampling (drop groups with no reward variance) and the soft
overlong penalty.

Dynamic sampling, in the loop:
    buf = DynamicSampler(prompts_wanted=cfg.data.train_batch_size, cfg=cfg.algorithm.filter_groups)
    while not buf.add(batch_with_rewards):       # generate another batch of prompts
        batch_with_rewards = ...
    batch = buf.take()                            # exactly prompts_wanted groups, metrics in buf.metrics()
"""
from __future__ import annotations

import numpy as np
import torch

from megarl.algos.config import FilterGroupsConfig
from megarl.algos.tensor_ops import group_rows
from megarl.protocol import DataProto


def groups_with_variance(uid, values) -> np.ndarray:
    """Row mask [B] keeping the groups whose `values` are not all equal (a group of one is kept:
    there is nothing to compare it with, as in DAPO)."""
    values = np.asarray([float(v) for v in values])
    keep = np.zeros(len(values), dtype=bool)
    for rows in group_rows(uid).values():
        if len(rows) == 1 or np.std(values[rows]) > 0:
            keep[rows] = True
    return keep


def filter_metric(batch, metric: str) -> np.ndarray:
    """Per-row values of `algorithm.filter_groups.metric`: seq_reward / seq_final_reward (summed
    token_level_rewards), score (summed token_level_scores), or any per-sample reward extra info
    (e.g. acc) stored in non_tensor_batch."""
    b, nt = batch.batch, batch.non_tensor_batch
    if metric in ("seq_reward", "seq_final_reward"):
        return b["token_level_rewards"].sum(-1).cpu().numpy()
    if metric == "score":
        return b["token_level_scores"].sum(-1).cpu().numpy()
    if metric in nt:
        return np.asarray([float(v) for v in nt[metric]])
    raise ValueError(f"algorithm.filter_groups.metric={metric!r} is neither seq_reward, score nor a per-sample "
                     f"reward field (have: {', '.join(sorted(nt)) or 'none'}); "
                     "return it from the reward function's dict")


class DynamicSampler:
    """Collect groups with reward variance across generation rounds until a batch is full."""

    def __init__(self, prompts_wanted: int, cfg: FilterGroupsConfig):
        self.wanted, self.cfg = prompts_wanted, cfg
        self.parts: list = []
        self.kept = self.seen = self.rounds = 0

    def add(self, batch) -> bool:
        """Add one generated batch (with rewards); True once enough groups are kept."""
        self.rounds += 1
        keep = groups_with_variance(batch.non_tensor_batch["uid"], filter_metric(batch, self.cfg.metric))
        uids = batch.non_tensor_batch["uid"]
        self.seen += len(set(uids))
        if keep.any():
            part = batch[np.nonzero(keep)[0]]
            self.parts.append(part)
            self.kept += len(set(part.non_tensor_batch["uid"]))
        if self.kept >= self.wanted:
            return True
        limit = self.cfg.max_num_gen_batches
        if limit > 0 and self.rounds >= limit:
            raise RuntimeError(
                f"algorithm.filter_groups: after {self.rounds} generation rounds only {self.kept} of the "
                f"{self.wanted} prompts wanted have responses that differ in {self.cfg.metric!r}; raise "
                "max_num_gen_batches (0 = no limit) or check that the reward is not constant")
        return False

    def take(self):
        """The first `prompts_wanted` kept groups, whole."""
        batch = DataProto.concat(self.parts)
        order: list = []
        rows: list[int] = []
        for uid, idx in group_rows(batch.non_tensor_batch["uid"]).items():
            if len(order) == self.wanted:
                break
            order.append(uid)
            rows.extend(idx)
        return batch[np.asarray(rows)]

    def metrics(self) -> dict[str, float]:
        return {"dapo/gen_rounds": self.rounds, "dapo/groups_seen": self.seen, "dapo/groups_kept": self.kept,
                "dapo/kept_fraction": self.kept / max(self.seen, 1)}


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment [B]: 0 up to max - buffer tokens, then falling linearly to
    -penalty_factor at the full budget."""
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
