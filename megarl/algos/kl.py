"""KL to the reference policy: per-token estimators, the in-reward penalty and its controllers.

Estimators of KL(pi || pi_ref) from samples of pi, per token (x = log pi - log pi_ref):
    k1 ("kl")          x                         unbiased, high variance, can be negative
    abs                |x|
    k2 ("mse")         x^2 / 2                   biased, low variance
    k3 ("low_var_kl")  exp(-x) - 1 + x           unbiased, non-negative (clamped to [-10, 10])
A "+" suffix (e.g. "k3+") keeps that estimator's value but takes the gradient of k2, whose
gradient is the unbiased one for KL-as-loss (Schulman's note; verl names it the same way).
"""
from __future__ import annotations

import math

import torch

from megarl.algos.config import KLControlConfig
from megarl.algos.registry import KL_ESTIMATORS
from megarl.algos.tensor_ops import masked_mean

register_kl = KL_ESTIMATORS.register


@register_kl("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@register_kl("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@register_kl("mse", "k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob) ** 2


@register_kl("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Clamps bound a single wild token (e.g. a rollout/trainer mismatch) instead of letting it
    # dominate the batch; same bounds as verl so numbers compare.
    neg = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (neg.exp() - neg - 1).clamp(-10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, R] by estimator name (see the module docstring)."""
    if kind.endswith("+"):
        value = KL_ESTIMATORS.get(kind[:-1])(log_prob, ref_log_prob)
        k2 = kl_k2(log_prob, ref_log_prob)
        return value.detach() + k2 - k2.detach()
    if kind == "full":
        raise ValueError("kl_penalty='full' needs the whole vocabulary distribution, which the workers do not "
                         "return; use low_var_kl (k3), kl (k1) or mse (k2)")
    return KL_ESTIMATORS.get(kind)(log_prob, ref_log_prob)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Ziegler et al. (2019): move the coefficient toward `target_kl`, at most 20% per horizon."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value, self.target, self.horizon = kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def make_kl_controller(cfg: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """From `algorithm.kl_ctrl` (KLControlConfig). Its state belongs in the trainer checkpoint."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)


@torch.no_grad()
def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, controller, kind: str = "kl") -> tuple[torch.Tensor, dict]:
    """KL in the reward: rewards = scores - beta * KL per token; then the controller adapts beta.

    Returns (token_level_rewards [B, R], metrics). The batch KL fed to the controller is the
    mean over sequences of each sequence's mean token KL (verl's `actor/reward_kl_penalty`).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_probs, ref_log_prob, kind) * mask                   # [B, R]
    beta = controller.value
    rewards = token_level_scores - beta * kld
    current = masked_mean(kld, mask, dim=-1).mean().item()
    controller.update(current_kl=current, n_steps=token_level_scores.shape[0])
    if not math.isfinite(current):
        raise FloatingPointError("KL to the reference is not finite; check ref_log_prob and old_log_probs")
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}
