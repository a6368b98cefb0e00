"""Rollout/trainer mismatch: diagnostics and importance-sampling corrections.

The engine samples from pi_rollout (its kernels, maybe lower precision, or older weights in
async training); the trainer's old_log_probs are pi_old on the same tokens. Their gap is logged
every step; with `algorithm.rollout_correction.rollout_is` set, the policy loss is reweighted,
with r = pi_old / pi_rollout and c = rollout_is_threshold:

    token            w = min(r, c)                      truncated IS per token (TIS)
    sequence         w = min(prod r, c)                 truncated IS per sequence
    masked_token     w = r if r <= c else 0             masked IS: outliers leave the loss
    masked_sequence  w = prod r if prod r <= c else 0   ... the whole sequence leaves it
    icepop           w = r if 1/c <= r <= c else 0      IcePop: two-sided token masking

Metric names follow verl's `rollout_corr/*`; `rollout_corr/masked_token_fraction` is the share
of response tokens a masking mode removed.
"""
from __future__ import annotations

import math

import torch

from megarl.algos.tensor_ops import masked_mean


@torch.no_grad()
def rollout_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0) -> torch.Tensor:
    """Truncated IS weights [B, R] (0 on masked positions), detached from the graph."""
    mask = response_mask.to(old_log_probs.dtype)
    log_w = (old_log_probs - rollout_log_probs) * mask                             # [B, R]
    cap = math.log(threshold)
    if level == "token":
        w = log_w.clamp(max=cap).exp()
    elif level == "sequence":
        w = log_w.sum(-1, keepdim=True).clamp(max=cap).exp().expand_as(log_w)
    elif level == "masked_token":
        w = torch.where(log_w <= cap, log_w.clamp(max=cap).exp(), torch.zeros_like(log_w))
    elif level == "masked_sequence":
        seq = log_w.sum(-1, keepdim=True)
        w = torch.where(seq <= cap, seq.clamp(max=cap).exp(), torch.zeros_like(seq)).expand_as(log_w)
    elif level == "icepop":
        keep = (log_w <= cap) & (log_w >= -cap)
        w = torch.where(keep, log_w.clamp(-cap, cap).exp(), torch.zeros_like(log_w))
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is: unknown level {level!r}; use token, sequence, "
                         "masked_token, masked_sequence or icepop")
    return w * mask


MASKING = ("masked_token", "masked_sequence", "icepop")


@torch.no_grad()
def masked_token_fraction(weights: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Share of response tokens a masking mode removed from the loss (weight exactly 0)."""
    m = response_mask > 0
    n = int(m.sum())
    return float(((weights == 0) & m).sum()) / n if n else 0.0


@torch.no_grad()
def rollout_is_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       level: str, threshold: float) -> dict[str, float]:
    """How the IS weights look before/after truncation (over the tokens or sequences they weight)."""
    mask = response_mask.to(old_log_probs.dtype)
    log_w = (old_log_probs - rollout_log_probs) * mask
    if level in ("sequence", "masked_sequence"):
        raw = log_w.sum(-1).clamp(-50, 50).exp()                                 # [B]
        sel = mask.sum(-1) > 0
        raw = raw[sel]
    else:
        raw = log_w.clamp(-50, 50).exp()[mask > 0]                              # [tokens]
    if raw.numel() == 0:
        return {}
    if level in MASKING:
        low = 1.0 / threshold if level == "icepop" else 0.0
        w = torch.where((raw <= threshold) & (raw >= low), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(max=threshold)
    ess = (w.sum() ** 2 / (w ** 2).sum().clamp(min=1e-12) / w.numel()).item()
    return {"rollout_corr/rollout_is_mean": w.mean().item(),
            "rollout_corr/rollout_is_std": w.std(unbiased=False).item(),
            "rollout_corr/rollout_is_max": w.max().item(), "rollout_corr/rollout_is_min": w.min().item(),
            "rollout_corr/rollout_is_eff_sample_size": ess,
            "rollout_corr/rollout_is_ratio_fraction_high": (raw > threshold).float().mean().item()}


@torch.no_grad()
def rollout_mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """Gap between trainer and engine log-probs on the sampled tokens (log every step).

    kl       mean over tokens of log pi_rollout - log pi_old  (KL(rollout || trainer) from rollout samples)
    k3_kl    mean of r - log r - 1 with r = pi_old / pi_rollout (non-negative per token)
    log_ppl_diff  mean over sequences of (mean token log pi_rollout - mean token log pi_old)
    """
    mask = response_mask.to(old_log_probs.dtype)
    if mask.sum() == 0:
        return {}
    diff = (rollout_log_probs - old_log_probs) * mask                             # log pi_rollout - log pi_old
    log_r = -diff                                                                # log(pi_old / pi_rollout)
    lens = mask.sum(-1).clamp(min=1)
    has = mask.sum(-1) > 0
    train_log_ppl = (-(old_log_probs * mask).sum(-1) / lens)[has]               # [B']
    roll_log_ppl = (-(rollout_log_probs * mask).sum(-1) / lens)[has]
    seq_diff = train_log_ppl - roll_log_ppl
    abs_tok = (old_log_probs - rollout_log_probs).abs()[mask > 0]
    prob_diff = (old_log_probs.exp() - rollout_log_probs.exp()).abs()[mask > 0]
    seq_log_r = log_r.sum(-1)[has].clamp(-50, 50)
    return {
        "rollout_corr/kl": masked_mean(diff, mask).item(),
        "rollout_corr/k3_kl": masked_mean(log_r.clamp(-20, 20).exp() - log_r - 1, mask).item(),
        "rollout_corr/training_log_ppl": train_log_ppl.mean().item(),
        "rollout_corr/rollout_log_ppl": roll_log_ppl.mean().item(),
        "rollout_corr/training_ppl": train_log_ppl.exp().mean().item(),
        "rollout_corr/rollout_ppl": roll_log_ppl.exp().mean().item(),
        "rollout_corr/log_ppl_diff": seq_diff.mean().item(),
        "rollout_corr/log_ppl_abs_diff": seq_diff.abs().mean().item(),
        "rollout_corr/log_ppl_diff_max": seq_diff.max().item(),
        "rollout_corr/log_ppl_diff_min": seq_diff.min().item(),
        "rollout_corr/ppl_ratio": seq_diff.exp().mean().item(),
        "rollout_corr/chi2_token": (masked_mean((2 * log_r).clamp(max=40).exp(), mask) - 1).item(),
        "rollout_corr/chi2_seq": ((2 * seq_log_r).clamp(max=40).exp().mean() - 1).item(),
        "rollout_corr/max_abs_log_prob_diff": abs_tok.max().item(),
        "training/rollout_probs_diff_mean": prob_diff.mean().item(),
        "training/rollout_probs_diff_max": prob_diff.max().item(),
    }
