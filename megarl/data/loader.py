"""Batches of prompts as DataProto, in a deterministic per-epoch order that resumes exactly.

    loader = PromptLoader(dataset, batch_size=cfg.data.train_batch_size, shuffle=True, seed=cfg.data.seed)
    batch = loader.next_batch()          # wraps into the next epoch by itself
    state = loader.state_dict()          # -> the trainer checkpoint
    loader.load_state_dict(state)        # a resumed run sees exactly the same next batches

Epoch e's order is a permutation drawn from (seed, e) alone, so it needs no saved RNG state and
is the same on every rank. The last partial batch of an epoch is dropped for training.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from megarl.protocol import DataProto

KNOWN = ("raw_prompt", "prompt_token_ids", "data_source", "reward_model", "extra_info", "index")


class ResumableSampler:
    def __init__(self, num_rows: int, batch_size: int, shuffle: bool = True, seed: int = 1, drop_last: bool = True):
        if num_rows < 1:
            raise ValueError("the dataset is empty")
        if drop_last and batch_size > num_rows:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the {num_rows} usable prompts; "
                             "lower it or add data")
        self.num_rows, self.batch_size, self.shuffle, self.seed, self.drop_last = (num_rows, batch_size, shuffle, seed,
                                                                                   drop_last)
        self.epoch, self.batch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next(self) -> tuple[int, int, np.ndarray]:
        """(epoch, batch number in the epoch, row indices), then advance (into the next epoch)."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        start = self.batch * self.batch_size
        rows = self.order(self.epoch)[start:start + self.batch_size]
        out = (self.epoch, self.batch, rows)
        self.batch += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "num_rows": self.num_rows,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_rows", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's data position was saved with {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}; resume with the same data files and data.* settings")
        self.epoch, self.batch = state["epoch"], state["batch"]


def collate(items: list[dict], epoch: int = 0, batch_no: int = 0, split: str = "train") -> DataProto:
    """Dataset items -> a prompt batch. Known fields go to non_tensor_batch; a user dataset's extra
    fields too, except tensors of one shape, which are stacked into `batch` (verl's trainer reads
    `data.batch['state']`). Each prompt gets a `uid` unique in the run and stable on resume."""
    non_tensor: dict[str, list] = {}
    tensors: dict[str, list] = {}
    for item in items:
        ids = item.get("prompt_token_ids", item.get("input_ids"))
        if ids is None:
            raise ValueError(f"a dataset item has neither prompt_token_ids nor input_ids (keys: {sorted(item)})")
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1)
            if isinstance(item.get("attention_mask"), torch.Tensor):
                ids = ids[item["attention_mask"].reshape(-1).bool()]
            ids = ids.tolist()
        row = {"raw_prompt": item.get("raw_prompt", item.get("prompt")), "prompt_token_ids": list(ids),
               "data_source": item.get("data_source"), "extra_info": item.get("extra_info") or {},
               "index": item.get("index")}
        rm = item.get("reward_model")
        row["reward_model"] = rm if isinstance(rm, dict) else {"ground_truth": item.get("ground_truth", rm)}
        for key, value in item.items():
            if key in row or key in ("input_ids", "attention_mask", "prompt", "ground_truth"):
                continue
            (tensors if isinstance(value, torch.Tensor) else non_tensor).setdefault(key, []).append(value)
        for key, value in row.items():
            non_tensor.setdefault(key, []).append(value)
    batch: dict[str, torch.Tensor] = {}
    for key, values in tensors.items():
        if len(values) == len(items) and len({tuple(v.shape) for v in values}) == 1:
            batch[key] = torch.stack(values)
        else:
            non_tensor[key] = values
    non_tensor["uid"] = [f"{split}-e{epoch}-b{batch_no}-{i}-{idx}" for i, idx in enumerate(non_tensor["index"])]
    # DataProto stores each list element-wise in an object array (token lists stay lists).
    return DataProto.from_dict(batch or None, non_tensor, {"epoch": epoch, "batch_in_epoch": batch_no})


class PromptLoader:
    def __init__(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 1, drop_last: bool = True,
                 split: str = "train"):
        self.dataset, self.split = dataset, split
        self.sampler = ResumableSampler(len(dataset), batch_size, shuffle, seed, drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.batches_per_epoch

    def next_batch(self) -> DataProto:
        epoch, batch_no, rows = self.sampler.next()
        return collate([self.dataset[int(i)] for i in rows], epoch, batch_no, self.split)

    def __iter__(self) -> Iterator[DataProto]:
        """The remaining batches of the current epoch (all of them after an epoch boundary)."""
        if self.sampler.batch >= self.batches_per_epoch:
            self.sampler.epoch, self.sampler.batch = self.sampler.epoch + 1, 0
        while self.sampler.batch < self.batches_per_epoch:
            yield self.next_batch()

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
