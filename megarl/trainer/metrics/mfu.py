"""Model FLOPs utilisation per role and step, as verl's `perf/mfu/actor`.

    meter = MFUMeter.from_parts(cfg, parts, world=ranks.world)
    metrics.update(meter.metrics(batch, timings))   # {"perf/mfu/actor": 0.31, ...}

MFU = model FLOPs of the phase (megarl/models/flops.py, real token counts) / (phase seconds x
devices x peak FLOP/s of one device). The peak is `trainer.peak_tflops` when set, else looked up
by the CUDA device's name in PEAK_TFLOPS (dense bf16/fp16 tensor-core peaks from the vendors'
data sheets). On CPU, or on a GPU the table does not know, there is no MFU unless the key is set.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megarl.models.flops import forward_flops, training_flops

log = logging.getLogger("megarl.trainer")

# (substring of torch.cuda.get_device_name().lower(), dense bf16 TFLOP/s); first match wins,
# so the specific names come before the family names.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("gh200", 989.0), ("h200", 989.0), ("h100 pcie", 756.0), ("h100 nvl", 835.0), ("h100", 989.0),
    ("h800", 989.0), ("h20", 148.0), ("gb200", 2500.0), ("b200", 2250.0), ("b100", 1750.0),
    ("a100", 312.0), ("a800", 312.0), ("l40s", 362.0), ("l40", 181.0), ("l4", 121.0),
    ("a6000", 155.0), ("a10", 125.0), ("4090", 165.0), ("mi300x", 1307.0), ("mi325x", 1307.0),
    ("mi250x", 383.0),
]


def table_peak_tflops(device_name: str) -> float | None:
    name = device_name.lower()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def resolve_peak_flops(setting_tflops: float | None, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device or None, where it came from)."""
    if setting_tflops is not None:
        return setting_tflops * 1e12, "trainer.peak_tflops"
    if device.type != "cuda":
        return None, "no MFU on CPU unless trainer.peak_tflops is set"
    name = torch.cuda.get_device_name(device)
    peak = table_peak_tflops(name)
    if peak is None:
        return None, f"no MFU: {name!r} is not in megarl's table of peaks; set trainer.peak_tflops"
    return peak * 1e12, f"{name}: {peak:g} TFLOP/s bf16 dense"


@dataclass(frozen=True)
class PhaseWork:
    metric: str          # perf/mfu/<metric>
    spec: object         # the role's ModelSpec
    head: str            # "lm" or "value"
    train: bool          # forward + backward (else forward only)
    repeats: int = 1     # PPO epochs over the batch
    recompute: bool = False

    def flops(self, seq_lens: list[int]) -> int:
        if self.train:
            return self.repeats * training_flops(self.spec, seq_lens, self.head, self.recompute)
        return forward_flops(self.spec, seq_lens, self.head)


class MFUMeter:
    def __init__(self, work: dict[str, PhaseWork], world: int, peak_flops: float | None):
        self.work, self.world, self.peak = work, world, peak_flops

    @classmethod
    def from_parts(cls, cfg, parts, world: int, device: torch.device) -> "MFUMeter":
        """Phase names are the fit loop's timers (timing_s/<phase>)."""
        peak, why = resolve_peak_flops(cfg.trainer.peak_tflops, device)
        if peak is None:
            log.info("megarl: %s", why)
        recompute = cfg.model.enable_gradient_checkpointing
        a = parts.actor.spec
        work = {"old_log_prob": PhaseWork("compute_log_prob", a, "lm", False),
                "update_actor": PhaseWork("actor", a, "lm", True, cfg.actor.ppo_epochs, recompute)}
        if parts.ref is not None:
            work["ref"] = PhaseWork("ref", parts.ref.engine.spec, "lm", False)
        if parts.critic is not None:
            c = parts.critic.spec
            work["values"] = PhaseWork("compute_values", c, "value", False)
            work["update_critic"] = PhaseWork("critic", c, "value", True, cfg.critic.ppo_epochs or 1,
                                              cfg.critic.model.enable_gradient_checkpointing)
        return cls(work, world, peak)

    def metrics(self, batch, timings: dict[str, float]) -> dict[str, float]:
        if self.peak is None:
            return {}
        lens = (batch.batch["prompt_lens"] + batch.batch["response_lens"]).tolist()
        out = {}
        for phase, w in self.work.items():
            seconds = timings.get(phase)
            if seconds:
                out[f"perf/mfu/{w.metric}"] = w.flops(lens) / (seconds * self.world * self.peak)
        return out
