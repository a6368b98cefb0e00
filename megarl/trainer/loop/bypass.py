"""Bypass mode: the rollout's log-probs as the old log-probs, no old-log-prob pass.

    algorithm.rollout_correction.bypass_mode: null | true | false     (verl's key)

The old log-probs are computed before any optimizer step of the step, from the weights the engine
generated with (synchronous loop, weights synced after every step). When the engine also computes
them the way the trainer does (megarl's built-in engine at fp32: log_softmax(logits / T) of the
sampled token, before penalties and truncation), the trainer's pass returns the rollout's numbers to
fp32 rounding (~1e-5 on the quickstart): that forward pass is redundant, for every mini-batch and
epoch of the step. null turns it on exactly there and says why it is off elsewhere:
- bf16/fp16 (the GPU default): engine and trainer kernels round differently (gaps ~1e-2);
- an engine that does not declare exact log-probs at that dtype (megarl/engines/,
  exact_logprob_dtypes: TensorRT-LLM, transformers' generate, a user's class unless it says so);
- rollout.placement=disaggregated: batches come from older weights (a real off-policy gap);
- rollout_is set: the IS weights pi_old / pi_rollout would all be 1.
true there is refused (algos/config.py check_bypass_mode) unless bypass_tolerance accepts a gap.

The mismatch metrics stay: the update's first mini-batch is forwarded before any optimizer step, so
its log-probs are the old policy's; the loss function measures rollout_corr/* on them (no extra
pass). Above the tolerance, null falls back to the pass (a warning); true stops the run.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from megarl.config.dtypes import short
from megarl.rollout.base import rollout_dtype
from megarl.rollout.registry import abilities
from megarl.workers.preflight import resolve_dtype

EXACT_TOLERANCE = 1e-3     # fp32 engine vs trainer: ~1e-5 measured; a bug (stale weights) is >> 1e-3


@dataclass
class Bypass:
    on: bool
    explicit: bool          # bypass_mode=true (a gap above the tolerance stops the run)
    tolerance: float
    reason: str

    def check(self, metrics: dict, step: int) -> None:
        """The step's measured gap against the tolerance (after the update that measured it)."""
        gap = metrics.get("rollout_corr/max_abs_log_prob_diff")
        if not self.on or gap is None or gap <= self.tolerance:
            return
        line = (f"step {step}: rollout and trainer log-probs differ by {gap:.3g} (> bypass tolerance "
                f"{self.tolerance:g}) on the first mini-batch")
        if self.explicit:
            raise RuntimeError(f"{line}; algorithm.rollout_correction.bypass_mode=true: raise bypass_tolerance "
                               "or set bypass_mode=false")
        warnings.warn(f"{line}; the old-log-prob pass runs again from the next step")
        self.on, self.reason = False, f"off since step {step}: measured gap {gap:.3g} > {self.tolerance:g}"


def resolve_bypass(cfg, device: torch.device) -> Bypass:
    rc, ro = cfg.algorithm.rollout_correction, cfg.rollout
    info, dtype = abilities(ro), rollout_dtype(ro.dtype, device)
    at = str(dtype).removeprefix("torch.")
    exact = dtype == resolve_dtype(cfg.actor.dtype, trainable=True) and info.logprobs_exact_at(at)
    tolerance = rc.bypass_tolerance if rc.bypass_tolerance is not None else EXACT_TOLERANCE
    if rc.bypass_mode is False:
        return Bypass(False, False, tolerance, "off (bypass_mode=false)")
    if rc.bypass_mode is True:
        if not exact and rc.bypass_tolerance is None:   # device=auto resolved to CUDA: bf16
            raise ValueError("algorithm.rollout_correction.bypass_mode=true: this engine/precision does not return "
                             "the trainer's log-probs to fp32 rounding; set bypass_tolerance or bypass_mode=false")
        return Bypass(True, True, tolerance, f"on (bypass_mode=true, tolerance {tolerance:g})")
    why = ("actor.router_replay.mode=R2 records routes in that pass" if cfg.actor.router_replay.mode == "R2"
           else "rollout.placement=disaggregated: batches come from older weights" if ro.placement == "disaggregated"
           else f"rollout_is={rc.rollout_is} needs pi_old apart from pi_rollout" if rc.rollout_is is not None
           else None if exact else f"the {ro.name} engine at this precision does not return the trainer's log-probs "
           "to fp32 rounding")
    if why:
        return Bypass(False, False, tolerance, f"off: {why}")
    return Bypass(True, False, tolerance, f"on: {info.called} at {short(at)}, synchronous "
                  "loop (the rollout's log-probs are the old policy's)")
