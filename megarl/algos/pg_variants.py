"""Policy losses beyond PPO clip, with verl's names, keys and values (verl 0.9.1's core_algos).

    cispo      sg[clip(r)] * A * log pi: clipping weighs the token but never removes its gradient (MiniMax-M1)
    sapo       a sigmoid gate of r instead of a hard clip, temperature actor.tau_pos / tau_neg by sign of A
    geo_mean   GMPO: the geometric mean of the clipped token ratios of a sequence times its mean advantage
    clip_cov   PPO clip, plus a few random tokens whose cov(A, log pi) lies in [clip_cov_lb, clip_cov_ub]
               left out of the gradient (Cui et al. 2025)
    kl_cov     the unclipped objective plus ppo_kl_coef * |log r| on the top kl_cov_ratio tokens by cov(A, log pi)
    gpg        -A * log pi (GPG), no ratio
    dro        -(A * log pi - dro_beta / 2 * (log r)^2)
    dppo_tv    DPPO: tokens whose probability moved more than clip_ratio_low/high (total variation) leave
    dppo_kl    the loss; dppo_kl measures the move by the binary KL; both weigh by sg[min(r, clip_ratio_c)]

The covariance selections of clip_cov / kl_cov, like verl's, are taken over the micro-batch the loss sees.
sapo and geo_mean ignore actor.loss_agg_mode as verl does (sapo: seq-mean-token-mean; geo_mean: mean over
sequences), so their value is verl's whatever the mode; docs/verl.md says so.
"""
from __future__ import annotations

import torch

from megarl.algos.losses import Aggregator, ClipParams, register_policy_loss
from megarl.algos.tensor_ops import masked_mean

def _log_ratio(old_log_prob, log_prob, clamp: bool = True) -> torch.Tensor:
    log_ratio = log_prob - old_log_prob
    return log_ratio.clamp(-20.0, 20.0) if clamp else log_ratio


def _weighted(losses, is_weights):
    return losses if is_weights is None else losses * is_weights


def _zero(ref: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=ref.device)


@register_policy_loss("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
               is_weights=None) -> tuple[torch.Tensor, dict]:
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    losses = _weighted(-clipped.detach() * advantages * log_prob, is_weights)
    metrics = {"actor/pg_clipfrac": masked_mean((ratio != clipped).float(), mask),
               "actor/ppo_kl": masked_mean(-log_ratio, mask), "actor/pg_clipfrac_lower": _zero(log_prob)}
    return agg(losses, mask), metrics


@register_policy_loss("sapo")
def sapo_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
              is_weights=None) -> tuple[torch.Tensor, dict]:
    log_ratio = _log_ratio(old_log_prob, log_prob)
    tau = torch.where(advantages > 0, torch.as_tensor(params.tau_pos, dtype=advantages.dtype),
                      torch.as_tensor(params.tau_neg, dtype=advantages.dtype)).to(advantages.device)
    gates = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)       # slope 1 at r = 1, like r itself
    losses = _weighted(-gates * advantages, is_weights)
    seq_agg = Aggregator("seq-mean-token-mean", agg.global_tokens, agg.global_seqs, agg.norm_len)
    metrics = {"actor/pg_clipfrac": _zero(log_prob), "actor/ppo_kl": masked_mean(-log_ratio, mask),
               "actor/pg_clipfrac_lower": _zero(log_prob)}
    return seq_agg(losses, mask), metrics


@register_policy_loss("geo_mean")
def geo_mean_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                  is_weights=None) -> tuple[torch.Tensor, dict]:
    """GMPO (Zhao et al. 2025): tokens clipped in log space by the sign of A, then one ratio per
    sequence, exp(mean log r); one loss per sequence, averaged over the mini-batch's sequences."""
    m = mask.to(log_prob.dtype)
    log_ratio = torch.where(mask > 0, _log_ratio(old_log_prob, log_prob, clamp=False), torch.zeros_like(log_prob))
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-params.clip_low, params.clip_high)
    token = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lens = m.sum(-1).clamp(min=1)
    ratio = ((token * m).sum(-1) / lens).exp()                                   # [b]
    seq_adv = (advantages * m).sum(-1) / lens
    losses = -seq_adv * ratio
    if is_weights is not None:
        losses = losses * ((is_weights + 1e-10).log() * m).sum(-1).div(lens).exp()
    per_seq = Aggregator("seq-mean-token-sum", agg.global_tokens, agg.global_seqs)
    clipped = (log_ratio != bounded).float()
    metrics = {"actor/pg_clipfrac": masked_mean(clipped * (advantages > 0), mask),
               "actor/ppo_kl": masked_mean(-log_ratio, mask),
               "actor/pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), mask)}
    return per_seq(losses[:, None], torch.ones_like(losses[:, None])), metrics


@torch.no_grad()
def _covariance(advantages, log_prob, mask) -> torch.Tensor:
    """(A - mean A) * (log pi - mean log pi) per token, means over the mask."""
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def clip_cov_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                  is_weights=None) -> tuple[torch.Tensor, dict]:
    log_ratio = _log_ratio(old_log_prob, log_prob, clamp=False)
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    valid = mask > 0
    cov = _covariance(advantages, log_prob.detach(), mask)
    candidates = valid & ~(loss2 > loss1) & (cov < params.clip_cov_ub) & (cov > params.clip_cov_lb)
    idx = torch.nonzero(candidates)
    n = max(int(params.clip_cov_ratio * mask.sum().item()), 1)
    # a random subset, drawn as verl draws it (CPU generator), so a seeded run picks verl's tokens
    idx = idx[torch.randperm(len(idx))[:n].to(idx.device)] if len(idx) else idx
    keep = torch.ones_like(advantages)
    keep[idx[:, 0], idx[:, 1]] = 0
    losses = _weighted(torch.maximum(loss1, loss2) * keep, is_weights)
    metrics = {"actor/pg_clipfrac": masked_mean((keep == 0).float(), mask),
               "actor/ppo_kl": masked_mean(-log_ratio, mask)}
    return agg(losses, mask), metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                is_weights=None) -> tuple[torch.Tensor, dict]:
    log_ratio = _log_ratio(old_log_prob, log_prob, clamp=False)
    losses = -advantages * log_ratio.exp()
    valid = mask > 0
    n_valid = int(valid.sum())
    if n_valid:
        with torch.no_grad():
            adv, lp = advantages[valid], log_prob[valid]
            cov = (adv - adv.mean()) * (lp - lp.mean())                           # [n_valid]
            top = torch.topk(cov, max(1, int(n_valid * params.kl_cov_ratio))).indices
            chosen = torch.zeros(n_valid, dtype=torch.bool, device=cov.device)
            chosen[top] = True
            penalised = torch.zeros_like(valid)
            penalised[valid] = chosen
        losses = torch.where(penalised, losses + params.ppo_kl_coef * log_ratio.abs(), losses)
    losses = _weighted(losses, is_weights)
    return agg(losses, mask), {"actor/ppo_kl": masked_mean(log_ratio.abs(), mask)}


@register_policy_loss("gpg")
def gpg_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
             is_weights=None) -> tuple[torch.Tensor, dict]:
    return agg(_weighted(-log_prob * advantages, is_weights), mask), {}


@register_policy_loss("dro")
def dro_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
             is_weights=None) -> tuple[torch.Tensor, dict]:
    if params.dro_beta is None or params.dro_beta <= 0:
        raise ValueError("loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0")
    log_ratio = log_prob - old_log_prob
    losses = _weighted(-(log_prob * advantages - 0.5 * params.dro_beta * log_ratio.square()), is_weights)
    return agg(losses, mask), {"actor/ppo_kl": masked_mean(-log_ratio, mask)}


def _dppo(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator, is_weights,
          valid_pos, valid_neg) -> tuple[torch.Tensor, dict]:
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = log_ratio.exp()
    cap = 3.0 if params.clip_c is None else params.clip_c
    weight = ratio.clamp(max=cap).detach()
    valid = torch.where(advantages > 0, valid_pos, valid_neg).detach().float()
    losses = _weighted(-advantages * weight * log_prob * valid, is_weights)
    metrics = {"actor/pg_clipfrac": masked_mean(1.0 - valid, mask), "actor/ppo_kl": masked_mean(-log_ratio, mask),
               "actor/pg_clipfrac_lower": masked_mean((ratio > cap).float() * valid, mask)}
    return agg(losses, mask), metrics


@register_policy_loss("dppo_tv")
def dppo_tv_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                 is_weights=None) -> tuple[torch.Tensor, dict]:
    moved = log_prob.exp() - old_log_prob.exp()
    return _dppo(old_log_prob, log_prob, advantages, mask, params, agg, is_weights,
                 moved <= params.clip_high, moved >= -params.clip_low)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                 is_weights=None) -> tuple[torch.Tensor, dict]:
    p, q = log_prob.exp(), old_log_prob.exp()
    binary_kl = q * (old_log_prob - log_prob) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return _dppo(old_log_prob, log_prob, advantages, mask, params, agg, is_weights,
                 (binary_kl <= params.clip_high) | (p <= q), (binary_kl <= params.clip_low) | (p >= q))
