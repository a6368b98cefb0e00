"""ReMax's reward baselines: the score of one greedy response per prompt, the baseline of that
prompt's n sampled responses (verl 0.9.1's RayPPOTrainer.fit: one do_sample=False response per
prompt, scored by the same reward, its summed score set as `reward_baselines`, the greedy batch
then dropped). The loop asks the estimator, not its name, whether it takes baselines.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from megarl.algos.advantages import get_adv_estimator
from megarl.protocol import DataProto
from megarl.trainer.loop.generation import generate


def takes_baselines(adv_estimator: str) -> bool:
    """The estimator reads `reward_baselines` (ReMax, or a user's estimator that declares it)."""
    return "reward_baselines" in inspect.signature(get_adv_estimator(adv_estimator)).parameters


def per_sample(prompt_uids: Sequence, prompt_scores: torch.Tensor, sample_uids: Sequence) -> torch.Tensor:
    """Each sample's baseline: the score of the greedy response to its prompt, found by uid, so the
    rows' order (rollout groups, dynamic sampling's rounds) does not matter."""
    by_uid = dict(zip((str(u) for u in prompt_uids), prompt_scores.tolist()))
    missing = [str(u) for u in sample_uids if str(u) not in by_uid]
    if missing:
        raise RuntimeError(f"no greedy baseline for prompt uid {missing[0]!r}: the engine returned responses to "
                           "prompts it was not given")
    return torch.tensor([by_uid[str(u)] for u in sample_uids], dtype=prompt_scores.dtype)


def add_reward_baselines(parts, ranks, prompts: DataProto, batch: DataProto, sampling, score: Callable) -> None:
    """One greedy response per prompt, scored by `score` (the run's reward, its result on every
    rank); its summed score goes on the prompt's samples as `reward_baselines`, and the greedy
    batch is dropped."""
    greedy = generate(parts.rollout, prompts, sampling.with_(n=1, do_sample=False), ranks, parts.pad_token_id)
    scores = score(greedy).token_level_scores.sum(-1)
    batch.batch["reward_baselines"] = per_sample(greedy.non_tensor_batch["uid"], scores, batch.non_tensor_batch["uid"])
