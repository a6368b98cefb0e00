"""The keys megarl's own policy losses read beside `actor_rollout_ref.actor.policy_loss.loss_mode`,
one Section per loss, with verl's names and defaults (verl 0.9.1's PolicyLossConfig for clip_cov,
kl_cov and dro; AReaL's for decoupled_ppo; M2PO's for m2po). Torch-free: megarl/algos/registry.py
declares them by path, so the config types and checks them without importing the losses.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.typed import Section, require


@dataclass
class ClipCovOptions(Section):
    """clip_cov leaves out of the gradient up to clip_cov_ratio of the tokens whose cov(A, log pi)
    lies in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def __post_init__(self):
        require(self.clip_cov_ratio > 0, "clip_cov_ratio", "must be > 0 (a fraction of the tokens)")
        require(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb", "must be below clip_cov_ub")


@dataclass
class KlCovOptions(Section):
    """kl_cov adds ppo_kl_coef * |log r| to the top kl_cov_ratio of the tokens by cov(A, log pi)."""
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self):
        require(self.kl_cov_ratio > 0, "kl_cov_ratio", "must be > 0 (a fraction of the tokens)")


@dataclass
class DroOptions(Section):
    """dro's quadratic penalty -(A log pi - dro_beta / 2 (log r)^2): no default, as verl."""
    dro_beta: float | None = None

    def __post_init__(self):
        require(self.dro_beta is not None and self.dro_beta > 0, "dro_beta",
                "loss_mode=dro needs dro_beta > 0 (the weight of its (log r)^2 penalty), e.g. 0.1")


@dataclass
class DecoupledOptions(Section):
    """decoupled_ppo: tokens whose pi_prox / pi_behav exceeds the cap leave the loss; None keeps all."""
    behav_imp_weight_cap: float | None = None

    def __post_init__(self):
        require(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1, "behav_imp_weight_cap",
                "must be > 1 (a weight of 1 is on-policy)")


@dataclass
class M2poOptions(Section):
    """m2po: the bound on the mean (log pi_prox / pi_behav)^2 of the tokens kept; None: 0.04."""
    m2_threshold: float | None = None

    def __post_init__(self):
        require(self.m2_threshold is None or self.m2_threshold > 0, "m2_threshold", "must be > 0")
