"""Configuration of the RL algorithm (`algorithm.*`), verl's keys and meanings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.dtypes import canonical
from megarl.config.errors import ConfigError
from megarl.config.typed import Section, require
from megarl.engines import EngineInfo, config_info

# Advantage estimators that compare the n responses of one prompt with each other (need n >= 2).
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "drgrpo", "dr_grpo", "rloo", "rloo_vectorized", "opo", "gpg",
                    "grpo_passk", "reinforce_plus_plus_baseline")
CRITIC_ESTIMATORS = ("gae",)


@dataclass
class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self):
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        require(self.horizon > 0, "horizon", "must be > 0 (samples over which the adaptive coefficient moves)")
        require(self.target_kl > 0, "target_kl", "must be > 0")


@dataclass
class FilterGroupsConfig(Section):
    """DAPO dynamic sampling: drop groups whose `metric` has zero variance and refill the batch."""
    enable: bool = False
    metric: str = "acc"                    # "acc", "score", "seq_reward", or another per-sample reward field
    max_num_gen_batches: int = 10          # rollouts per step before giving up (0 = no limit)

    def __post_init__(self):
        require(self.max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = no limit)")


@dataclass
class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment inside the last `len` tokens of the response budget."""
    enable: bool = False
    len: int = 16
    penalty_factor: float = 1.0
    log: bool = False                      # accepted for verl compatibility; the penalty is always logged

    def __post_init__(self):
        require(self.len >= 1, "len", "must be >= 1 token")
        require(self.penalty_factor >= 0, "penalty_factor", "must be >= 0")


@dataclass
class RolloutCorrectionConfig(Section):
    """Rollout/trainer mismatch: truncated importance sampling from the rollout's log-probs."""
    # None: only log the mismatch. token/sequence: truncated IS (verl's); masked_token/masked_sequence:
    # masked IS; icepop: tokens whose ratio leaves [1/c, c] are masked (megarl/algos/rollout_correction.py).
    rollout_is: Literal["token", "sequence", "masked_token", "masked_sequence", "icepop"] | None = None
    rollout_is_threshold: float = 2.0      # c: weights are truncated (or masked) at this value
    # verl's key (verl/trainer/config/algorithm.py at b178a3c): true uses the rollout's log-probs as
    # the old log-probs and skips the actor's old-log-prob pass. null (megarl's default): true where
    # that changes nothing, i.e. the built-in engine at fp32 in the synchronous loop, false elsewhere
    # (megarl/trainer/loop/bypass.py; the run's first lines say which and why).
    bypass_mode: bool | None = None
    loss_type: str = "ppo_clip"            # verl's bypass loss: ppo_clip only (megarl/config/refused.py)
    # megarl's: the largest |log pi_rollout - log pi_old| on a token that bypass accepts, checked every
    # step on the first mini-batch. null: 1e-3 for the built-in engine at fp32; another engine or
    # precision needs it set to run bypass_mode=true.
    bypass_tolerance: float | None = None

    def __post_init__(self):
        require(self.rollout_is_threshold >= 1.0, "rollout_is_threshold",
                "must be >= 1 (weights above it are truncated)")
        require(self.bypass_tolerance is None or self.bypass_tolerance > 0, "bypass_tolerance",
                "must be > 0 (a log-prob difference) or null")


@dataclass
class AlgorithmConfig(Section):
    adv_estimator: str = "gae"             # gae, grpo, drgrpo, rloo, reinforce_plus_plus, remax, ...
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"                 # kl (k1), abs, mse (k2), low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self):
        require(0 <= self.gamma <= 1, "gamma", "must be within [0, 1]")
        require(0 <= self.lam <= 1, "lam", "must be within [0, 1]")
        # adv_estimator and kl_penalty are names in megarl.algos's registries, checked by
        # registry.check_algorithm_names once model.external_lib, which may register more, is imported

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS

    @property
    def is_group_relative(self) -> bool:
        return self.adv_estimator in GROUP_ESTIMATORS


# -- rules across sections (run once by ExperimentConfig; `cfg` is the ExperimentConfig) --------
def check_group_size(cfg) -> None:
    """A group-relative estimator compares the responses of one prompt."""
    algo, n = cfg.algorithm, cfg.rollout.n
    if algo.is_group_relative and n < 2:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator} compares the responses of one "
                          f"prompt, so it needs actor_rollout_ref.rollout.n >= 2 (got {n})",
                          "actor_rollout_ref.rollout.n")


def check_critic_on(cfg) -> None:
    if cfg.algorithm.needs_critic and not cfg.critic.enable:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic; set critic.enable=true or pick "
                          "a critic-free estimator such as grpo", "critic.enable")


def _run_dtype(name: str, device: str) -> str:
    """The dtype a model runs at, as far as the config says: auto is bf16 on CUDA, fp32 elsewhere
    (device=auto on a GPU machine is caught at start by trainer/loop/bypass.py resolve_bypass)."""
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return canonical(name) or name     # canonical: the name EngineInfo.exact_logprob_dtypes uses


def check_bypass_mode(cfg, info: EngineInfo | None = None) -> None:
    """bypass_mode=true where the rollout's log-probs cannot stand for the old policy's. `info`: the
    engine's declaration where it is known only once its class loads (a user's class, preflight)."""
    rc, ro = cfg.algorithm.rollout_correction, cfg.rollout
    info = info or config_info(ro.name)
    if rc.bypass_mode is not True or info is None:     # None: a user's class, checked once it loads
        return
    key = "algorithm.rollout_correction.bypass_mode"
    if cfg.actor.router_replay.mode == "R2":
        raise ConfigError("cannot be true with actor_rollout_ref.actor.router_replay.mode=R2: R2 records the routes "
                          "in the old-log-prob pass this would skip; use mode=R3 or set bypass_mode=false", key)
    if ro.placement == "disaggregated":
        raise ConfigError("cannot be true with rollout.placement=disaggregated: batches there come from older weights "
                          "(up to async_training.max_staleness steps), so the rollout's log-probs are not the old "
                          "policy's; set it to false (the old-log-prob pass then runs)", key)
    if rc.rollout_is is not None:
        raise ConfigError(f"cannot be true with rollout_is={rc.rollout_is}: the IS weights pi_old / pi_rollout are "
                          "then 1; drop rollout_is or set bypass_mode=false", key)
    dtype = _run_dtype(ro.dtype, cfg.trainer.device)
    exact = dtype == _run_dtype(cfg.actor.dtype, cfg.trainer.device) and info.logprobs_exact_at(dtype)
    if not exact and rc.bypass_tolerance is None:
        raise ConfigError(f"is true, but the {ro.name} engine at this precision does not return the trainer's "
                          "log-probs to fp32 rounding; accept a gap with algorithm.rollout_correction.bypass_tolerance="
                          "<largest |log-prob difference|> (checked every step) or set bypass_mode=false", key)
