"""Policy losses for stale data: a proximal policy separate from the behaviour policy.

Three policies per token: pi_behav sampled it (the engine's log-prob, `rollout_log_probs`),
pi_prox is the trainer's policy when the step began (`old_log_probs`, recomputed), pi_theta is
being optimised. The PPO trust region is taken around pi_prox, whatever version sampled the
token, and the off-policy gap is corrected by an importance weight pi_prox / pi_behav
(Hilton et al. 2022, as AReaL's decoupled loss):

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))    (dual clip for A < 0)
    r_t = pi_theta / pi_prox,   w_t = sg[pi_prox / pi_behav]

decoupled_ppo: tokens whose w_t exceeds `behav_imp_weight_cap` leave the loss (w_t = 0), as
AReaL's cap; None keeps every token.
m2po: instead of a cap, the tokens with the largest (log w_t)^2 leave the loss until the mean of
(log w)^2 over those left is at most `m2_threshold` (M2PO's second-moment bound, 0.04 by default).
The bound is taken over the micro-batch the loss sees.

    loss, metrics = decoupled_ppo_loss(prox_lp, lp, adv, mask, params, agg, behav_log_prob=behav_lp)
"""
from __future__ import annotations

import torch

from megarl.algos.losses import Aggregator, ClipParams, ppo_clip_objective, register_policy_loss
from megarl.algos.tensor_ops import masked_mean

M2_THRESHOLD = 0.04


@torch.no_grad()
def second_moment_keep(log_w: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[b, R] bool: the tokens kept once the fewest largest (log w)^2 are removed so that the mean
    of (log w)^2 over the kept tokens is <= threshold."""
    valid = mask > 0
    m2 = (log_w.float() ** 2)[valid]                                   # [n]
    order = m2.argsort(descending=True)
    tail = m2[order].flip(0).cumsum(0).flip(0)                          # tail[i] = sum of m2 from rank i on
    remaining = torch.arange(len(m2), 0, -1, device=m2.device, dtype=m2.dtype)
    ok = (tail / remaining <= threshold).nonzero()
    drop = int(ok[0]) if len(ok) else len(m2)                           # the fewest to remove
    keep = torch.ones(len(m2), dtype=torch.bool, device=m2.device)
    keep[order[:drop]] = False
    out = torch.zeros_like(valid)
    out[valid] = keep
    return out


def _decoupled(prox_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
               behav_log_prob, keep_fn) -> tuple[torch.Tensor, dict]:
    if behav_log_prob is None:
        raise ValueError("the decoupled losses need the behaviour policy's log-probs (rollout_log_probs); "
                         "the rollout engine must return log-probs")
    log_w = (prox_log_prob - behav_log_prob.to(prox_log_prob.device)).detach().clamp(-20.0, 20.0)
    keep = keep_fn(log_w) & (mask > 0)
    weights = torch.where(keep, log_w.exp(), torch.zeros_like(log_w))          # [b, R]
    loss, metrics = ppo_clip_objective(prox_log_prob, log_prob, advantages, mask, params, agg, weights, dual=True)
    metrics["actor/behav_imp_weight_mean"] = masked_mean(weights, mask)
    metrics["actor/behav_masked_fraction"] = masked_mean((~keep).float(), mask)
    metrics["actor/behav_kl"] = masked_mean(-log_w, mask)
    return loss, metrics


@register_policy_loss("decoupled_ppo")
def decoupled_ppo_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                       is_weights=None, behav_log_prob=None) -> tuple[torch.Tensor, dict]:
    """AReaL's decoupled PPO: `old_log_prob` is the proximal policy's (module docstring)."""
    cap = params.behav_imp_weight_cap
    return _decoupled(old_log_prob, log_prob, advantages, mask, params, agg, behav_log_prob,
                      lambda log_w: torch.ones_like(mask, dtype=torch.bool) if cap is None else log_w.exp() <= cap)


@register_policy_loss("m2po")
def m2po_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
              is_weights=None, behav_log_prob=None) -> tuple[torch.Tensor, dict]:
    """The decoupled loss with M2PO's second-moment masking in place of the cap."""
    tau = M2_THRESHOLD if params.m2_threshold is None else params.m2_threshold
    return _decoupled(old_log_prob, log_prob, advantages, mask, params, agg, behav_log_prob,
                      lambda log_w: second_moment_keep(log_w, mask, tau))


# the actor's loss function (algos/loss_fn.py) reads this mark to pass the behaviour log-probs
for _loss in (decoupled_ppo_loss, m2po_loss):
    setattr(_loss, "needs_behaviour_log_probs", True)
