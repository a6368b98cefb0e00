"""Policy, value and entropy losses, and how a [B, R] loss matrix becomes a scalar.

Aggregation under the gradient contract with the Megatron worker: the worker sums each
micro-batch loss's gradient over micro-batches and DP ranks, and tells us the mini-batch's
totals (`global_tokens`: response-mask tokens, `global_seqs`: sequences). Normalising by those
totals instead of by the micro-batch's own counts makes the mini-batch loss exact however it is
split: token-mean = sum(loss * mask) / global_tokens, seq-mean-* = sum over our sequences / global_seqs,
token-sum = sum(loss * mask) (no normaliser: the worker's DP sum is already the mini-batch's sum).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.algos.registry import POLICY_LOSSES
from megarl.algos.tensor_ops import masked_mean

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class Aggregator:
    """`mode` plus the normalisers. Without global counts it averages over the tensors it is given
    (a single micro-batch is the whole mini-batch). `norm_len` is Dr. GRPO's constant length
    (the response budget) for seq-mean-token-sum-norm; it must not vary between micro-batches."""
    mode: str = "token-mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    norm_len: float | None = None

    def __post_init__(self):
        if self.mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # where, not a product: a non-finite value on a padded position (a ratio that overflowed
        # there) must not turn the loss into NaN
        loss_mat = torch.where(mask > 0, loss_mat, torch.zeros_like(loss_mat))
        mask = mask.to(loss_mat.dtype)
        tokens = max(self.global_tokens, 1) if self.global_tokens is not None else mask.sum().clamp(min=1)
        seqs = max(self.global_seqs, 1) if self.global_seqs is not None else max(loss_mat.shape[0], 1)
        per_seq = (loss_mat * mask).sum(-1)                                          # [b]
        if self.mode == "token-mean":
            return per_seq.sum() / tokens
        if self.mode == "token-sum":
            return per_seq.sum()
        if self.mode == "seq-mean-token-sum":
            return per_seq.sum() / seqs
        if self.mode == "seq-mean-token-mean":
            return (per_seq / mask.sum(-1).clamp(min=1)).sum() / seqs
        norm = self.norm_len if self.norm_len is not None else loss_mat.shape[-1]
        return per_seq.sum() / (seqs * norm)

    def local(self) -> "Aggregator":
        """The same mode over the given tensors only (for per-micro-batch metrics)."""
        return Aggregator(self.mode, None, None, self.norm_len)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", **norms) -> torch.Tensor:
    return Aggregator(mode, **norms)(loss_mat, mask)


# -- policy losses -------------------------------------------------------------------------------
@dataclass
class ClipParams:
    clip_low: float = 0.2                  # ratio may fall to 1 - clip_low
    clip_high: float = 0.2                 # ratio may rise to 1 + clip_high (DAPO's clip-higher: larger)
    clip_c: float | None = 3.0             # dual-clip bound for negative advantages; None = off
    behav_imp_weight_cap: float | None = None   # decoupled_ppo: pi_prox / pi_behav above it leaves the loss
    m2_threshold: float | None = None      # m2po: the second-moment bound (None: 0.04)
    # verl's actor.tau_pos / tau_neg (sapo) and actor.policy_loss.* (clip_cov, kl_cov, dro), verl's defaults
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    # the loss's own options as the config gives them (its registered options class), None when it has
    # none; megarl's losses read the fields above, which their options fill by name
    options: Any = None


register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(name: str):
    return POLICY_LOSSES.get(name)


def ppo_clip_objective(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
              is_weights=None, dual: bool = True) -> tuple[torch.Tensor, dict]:
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)                    # [b, R]
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    clipped = torch.maximum(loss1, loss2)
    metrics = {"actor/pg_clipfrac": masked_mean((loss2 > loss1).float(), mask),
               "actor/ppo_kl": masked_mean(-log_ratio, mask)}
    if dual and params.clip_c is not None:
        # Dual clip (Ye et al. 2020): with A < 0 a huge ratio would make the loss unbounded;
        # cap it at -A * clip_c.
        loss3 = -advantages * params.clip_c
        lower = torch.minimum(loss3, clipped)
        metrics["actor/pg_clipfrac_lower"] = masked_mean(((clipped > loss3) & (advantages < 0)).float(), mask)
        clipped = torch.where(advantages < 0, lower, clipped)
    else:
        metrics["actor/pg_clipfrac_lower"] = torch.zeros((), device=log_prob.device)
    if is_weights is not None:
        clipped = clipped * is_weights
    return agg(clipped, mask), metrics


@register_policy_loss("vanilla", "dual_clip")
def ppo_dual_clip_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                       is_weights=None) -> tuple[torch.Tensor, dict]:
    """PPO clip with separate low/high bounds plus the dual-clip bound `clip_c` for A < 0.
    This is what verl calls `vanilla`; `dual_clip` names the same loss explicitly."""
    return ppo_clip_objective(old_log_prob, log_prob, advantages, mask, params, agg, is_weights, dual=True)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
                  is_weights=None) -> tuple[torch.Tensor, dict]:
    """The original PPO clip objective, without the dual-clip bound."""
    return ppo_clip_objective(old_log_prob, log_prob, advantages, mask, params, agg, is_weights, dual=False)


@register_policy_loss("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, mask, params: ClipParams, agg: Aggregator,
              is_weights=None) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
    clipped as a whole. The token form sg[s_i] * pi_t / sg[pi_t] has value s_i and the gradient
    of s_i once averaged over the sequence's tokens. Aggregated by actor.loss_agg_mode, as verl
    does; the paper's own choice is seq-mean-token-mean."""
    m = mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)                 # [b]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = token_log_ratio.clamp(max=10.0).exp()                                   # [b, R]
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    losses = torch.maximum(loss1, loss2)
    if is_weights is not None:
        losses = losses * is_weights
    metrics = {"actor/pg_clipfrac": masked_mean((loss2 > loss1).float(), mask),
               "actor/ppo_kl": masked_mean(-log_ratio, mask),
               "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device)}
    return agg(losses, mask), metrics


# -- value loss ----------------------------------------------------------------------------------
def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, agg: Aggregator) -> tuple[torch.Tensor, dict]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), as PPO's critic."""
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * agg(torch.maximum(loss1, loss2), mask)
    metrics = {"critic/vf_clipfrac": masked_mean((loss2 > loss1).float(), mask),
               "critic/vpred_mean": masked_mean(vpreds.detach(), mask)}
    return loss, metrics

