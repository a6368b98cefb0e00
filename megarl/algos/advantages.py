"""Advantage estimators: token-level rewards in, (advantages, returns) [B, R] out.

    adv, ret = get_adv_estimator("grpo")(token_level_rewards, response_mask, uid=uid)
    batch = compute_advantage(batch, cfg.algorithm)     # reads/writes the protocol's fields

Every estimator takes keyword arguments and ignores the ones it does not use, so the loop can
pass everything it has. `uid` (one id per prompt, shared by its n responses) defines the groups
of the group-relative estimators. Meanings follow verl's core_algos, estimator by estimator.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megarl.algos.config import AlgorithmConfig
from megarl.algos.registry import ADV_ESTIMATORS
from megarl.algos.tensor_ops import masked_whiten

register_adv_estimator = ADV_ESTIMATORS.register


def get_adv_estimator(name: str):
    return ADV_ESTIMATORS.get(name)


def _need(value, what: str, name: str):
    if value is None:
        raise ValueError(f"advantage estimator {name!r} needs {what}")
    return value


def group_index(uid: Sequence | np.ndarray, device=None) -> tuple[torch.Tensor, int]:
    """Row -> dense group number (first-seen order) and the number of groups."""
    _, first, inverse = np.unique(np.asarray(list(uid), dtype=object).astype(str), return_index=True,
                                  return_inverse=True)
    order = np.argsort(np.argsort(first))                 # renumber groups by first appearance
    return torch.as_tensor(order[inverse], dtype=torch.long, device=device), len(first)


def group_stats(scores: torch.Tensor, uid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: its group's mean, unbiased std and size. Singleton groups get mean 0 and std 1,
    as in verl, so a lone response keeps its raw score instead of a 0/0."""
    gid, n_groups = group_index(uid, scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    mean = torch.zeros_like(counts).index_add_(0, gid, scores) / counts
    sq = torch.zeros_like(counts).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]                                        # each [B]


@register_adv_estimator("gae")
@torch.no_grad()
def gae(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor | None = None,
        gamma: float = 1.0, lam: float = 1.0, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a critic; advantages are whitened over the batch.

    Masked positions (padding, tool output) are skipped: the recursion carries the next value
    and the running advantage across them, so tool output inside a response does not cut it.
    """
    values = _need(values, "critic values [B, R] (batch 'values'; enable the critic)", "gae")
    mask = response_mask.to(values.dtype)
    B, R = token_level_rewards.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    running = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(R)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        running = m * candidate + (1 - m) * running
        adv[:, t] = running
    returns = adv + values
    return masked_whiten(adv, mask) * mask, returns


@register_adv_estimator("grpo", "grpo_vectorized")
@torch.no_grad()
def grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
         norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(score - group mean) / (group std + eps), broadcast over the response tokens."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "grpo")
    scores = token_level_rewards.sum(-1)                                          # [B]
    mean, std = group_stats(scores, uid)[:2]
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("drgrpo", "dr_grpo")
@torch.no_grad()
def drgrpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
           **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: score minus group mean, no std scaling. Its other half, the length-unbiased
    loss, is `actor.loss_agg_mode=seq-mean-token-sum-norm`."""
    kw.pop("norm_adv_by_std_in_grpo", None)
    return grpo(token_level_rewards, response_mask, uid=uid, norm_adv_by_std_in_grpo=False, **kw)


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
         **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: score minus the mean of the other responses of the same prompt,
    i.e. n/(n-1) * (score - group mean). A lone response keeps its raw score (verl)."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "rloo")
    scores = token_level_rewards.sum(-1)
    mean, n = group_stats(scores, uid)[::2]
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("rloo_vectorized")
@torch.no_grad()
def rloo_vectorized(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
                    **_) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: the same leave-one-out advantage, but a lone response gets 0 (no other
    response to compare with) where `rloo` keeps its raw score."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "rloo_vectorized")
    scores = token_level_rewards.sum(-1)
    mean, n = group_stats(scores, uid)[::2]
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(scores))
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("opo")
@torch.no_grad()
def opo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): score minus the group's length-weighted mean score, the optimal baseline
    for a sequence-level reward; a lone response keeps its raw score (verl)."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "opo")
    scores = token_level_rewards.sum(-1)
    lens = response_mask.to(scores.dtype).sum(-1)
    gid, n_groups = group_index(uid, scores.device)
    weighted = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, lens * scores)
    total = torch.zeros_like(weighted).index_add_(0, gid, lens)
    count = torch.zeros_like(weighted).index_add_(0, gid, torch.ones_like(scores))
    baseline = torch.where(count[gid] > 1, weighted[gid] / total[gid].clamp(min=1), torch.zeros_like(scores))
    adv = (scores - baseline)[:, None] * response_mask.to(scores.dtype)
    return adv, adv


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): score minus group mean, scaled by batch size / responses with a non-zero
    score, so that groups without signal do not dilute the gradient (verl's f_norm is 1)."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "gpg")
    scores = token_level_rewards.sum(-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = alpha * (scores - group_stats(scores, uid)[0])
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def grpo_passk(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
               norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k: only the best response of each group is credited, with best minus second best."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "grpo_passk")
    scores = token_level_rewards.sum(-1)
    std = group_stats(scores, uid)[1]
    adv = torch.zeros_like(scores)
    gid, n_groups = group_index(uid, scores.device)
    for g in range(n_groups):
        rows = torch.nonzero(gid == g).squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs >= 2 responses per prompt; group {g} has {len(rows)}")
        top = torch.topk(scores[rows], 2)
        gap = top.values[0] - top.values[1]
        best = rows[top.indices[0]]
        adv[best] = gap / (std[best] + epsilon) if norm_adv_by_std_in_grpo else gap
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go per token; the running sum restarts at masked positions (after EOS)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
                        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the whole batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _discounted_returns(token_level_rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid=None,
                                 **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch."""
    uid = _need(uid, "group ids (non_tensor_batch 'uid', one per prompt)", "reinforce_plus_plus_baseline")
    mask = response_mask.to(token_level_rewards.dtype)
    scores = token_level_rewards.sum(-1)
    mean = group_stats(scores, uid)[0]
    adv = (scores - mean)[:, None] * mask
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_estimator("remax")
@torch.no_grad()
def remax(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor | None = None,
          **_) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return-to-go minus the score of the greedy response to the same prompt."""
    reward_baselines = _need(reward_baselines, "reward_baselines [B] (the greedy rollout's scores)", "remax")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines[:, None] * mask, returns


def compute_advantage(batch, cfg: AlgorithmConfig) -> "object":
    """Fill `advantages` and `returns` of a DataProto from its rewards, per `cfg` (AlgorithmConfig)."""
    fn = get_adv_estimator(cfg.adv_estimator)
    b, nt = batch.batch, batch.non_tensor_batch
    adv, ret = fn(token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
                  uid=nt.get("uid"), values=b["values"] if "values" in b else None,
                  reward_baselines=b["reward_baselines"] if "reward_baselines" in b else None,
                  gamma=cfg.gamma, lam=cfg.lam, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
    b["advantages"], b["returns"] = adv, ret
    return batch
