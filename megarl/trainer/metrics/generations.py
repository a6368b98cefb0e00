"""Generations as verl writes them: `trainer.rollout_data_dir` and `trainer.validation_data_dir` get
one `<step>.jsonl` per step, a line per sample, in verl 0.9.1's fields (RayPPOTrainer._dump_generations):

    {"input": prompt text, "output": response text, "gts": ground truth, "score": summed token scores,
     "step": 3, <each key of the reward's extra info>: value, ...}

`trainer.log_val_generations=N` picks N validation samples as verl does (sorted by input, shuffled
with seed 42); validation returns them under SAMPLES_KEY and the loop logs them (MetricsLogger.
log_generations: <run dir>/val_generations.jsonl always, wandb's table and TensorBoard's text as verl).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from megarl.reward.manager import EXTRA_COLUMN, ground_truth_of
from megarl.reward.placement import response_lengths
from megarl.storage.private_out import check_output_dir, new_file


@dataclass
class Generations:
    """Decoded samples of one batch with their scores and the reward's extra info (columns)."""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    gts: list = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    extra: dict[str, list] = field(default_factory=dict)

    def extend(self, other: "Generations") -> None:
        n = len(self.inputs)
        for key in other.extra:      # a key first seen in a later batch is None for the earlier rows
            self.extra.setdefault(key, [None] * n)
        for key, values in self.extra.items():
            values.extend(other.extra.get(key, [None] * len(other.inputs)))
        self.inputs += other.inputs
        self.outputs += other.outputs
        self.gts += other.gts
        self.scores += other.scores


def decode(batch, tokenizer, extra: dict[str, list] | None = None) -> Generations:
    """The batch's prompts and responses as text (special tokens dropped, as verl decodes them), its
    summed token-level scores, and `extra` (columns), else the rows' reward extra info."""
    nt, n = batch.non_tensor_batch, len(batch)
    prompts = [list(p) for p in nt["prompt_token_ids"]] if "prompt_token_ids" in nt else [[]] * n
    lens = response_lengths(batch).tolist()
    responses = [r[:k].tolist() for r, k in zip(batch.batch["responses"], lens)]
    gts = [ground_truth_of(row) for row in nt.get("reward_model", [None] * n)]
    scores = batch.batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch.batch else [None] * n
    if extra is None:
        rows = [r or {} for r in nt.get(EXTRA_COLUMN, [None] * n)]
        extra = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
    return Generations(tokenizer.batch_decode(prompts, skip_special_tokens=True),
                       tokenizer.batch_decode(responses, skip_special_tokens=True), gts, scores, dict(extra))


def write_jsonl(directory: str, step: int, gen: Generations, key: str = "trainer.rollout_data_dir") -> str:
    """<directory>/<step>.jsonl as verl's _write_generations writes it; an extra column whose length
    is not the sample count is left out, as verl leaves it. The directory may be shared: it must be
    this user's alone, and the file never follows a link planted there (megarl/storage/private_out.py)."""
    check_output_dir(directory, key)
    n = len(gen.inputs)
    columns = {"input": gen.inputs, "output": gen.outputs, "gts": gen.gts, "score": gen.scores, "step": [step] * n}
    columns.update({k: v for k, v in gen.extra.items() if len(v) == n})
    with new_file(directory, f"{step}.jsonl") as f:
        for i in range(n):
            f.write(json.dumps({k: _plain(v[i]) for k, v in columns.items()}, ensure_ascii=False, default=str) + "\n")
    return os.path.join(directory, f"{step}.jsonl")


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def pick_for_log(gen: Generations, count: int) -> list[tuple[str, str, float]]:
    """verl's _maybe_log_val_generations: (input, output, score) sorted by input, shuffled by a
    RandomState(42), the first `count`: the same prompts every validation, so steps compare."""
    if count <= 0:
        return []
    samples = sorted(zip(gen.inputs, gen.outputs, gen.scores), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:count]


SAMPLES_KEY = "_val_generations"   # validation's picked samples ride in its metrics dict to the logging rank


def dump_rollout(trainer_cfg, tokenizer, step: int, batch) -> None:
    """trainer.rollout_data_dir/<step>.jsonl of the step's scored batch (call on one rank)."""
    if trainer_cfg.rollout_data_dir:
        write_jsonl(trainer_cfg.rollout_data_dir, step, decode(batch, tokenizer))


def dump_validation(trainer_cfg, step: int, gen: Generations) -> dict:
    """trainer.validation_data_dir/<step>.jsonl; {SAMPLES_KEY: picked} for log_val_generations."""
    if trainer_cfg.validation_data_dir:
        write_jsonl(trainer_cfg.validation_data_dir, step, gen, "trainer.validation_data_dir")
    picked = pick_for_log(gen, trainer_cfg.log_val_generations)
    return {SAMPLES_KEY: picked} if picked else {}
