"""The trainer's MoE router losses: their gradient scale and their metrics.

    with moe_loss_scale(config, spec, global_micro_batches):   # around one mini-batch's schedule
        schedule.run(...)
    metrics.update(moe_metrics(spec, layout, device, calls, "actor"))   # after train(): actor/moe_aux_loss, ...

megatron adds each router's load-balancing (aux) and z-loss to the gradient inside the MoE
layer. megarl's gradient contract (megarl/workers/engine.py) sums d(loss) over micro-batches and
DP ranks, so a router loss added at full weight per micro-batch would grow with the number of
micro-batches. HF's trainer adds coef * aux once per batch (averaged over gradient accumulation
and DP), so megarl scales the coefficients by 1 / (micro-batches in the mini-batch, all DP ranks)
while the mini-batch runs: the applied gradient is then d(coef * mean aux) as in HF. The routers
add their loss unscaled by token count (megarl/models/build.py sets that up).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from megarl.parallel import state

# megatron's tracker names -> megarl's metric names
_TRACKED = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}


@contextlib.contextmanager
def moe_loss_scale(config, spec, global_micro_batches: int):
    if not spec.is_moe:
        yield
        return
    aux, z = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    config.moe_aux_loss_coeff = aux / global_micro_batches
    config.moe_z_loss_coeff = None if z is None else z / global_micro_batches
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z


def moe_metrics(spec, layout, device: torch.device, calls: int, prefix: str) -> dict[str, float]:
    """Mean over MoE layers and this step's micro-batches (`calls` on this rank) of each router
    loss (unscaled by its coefficient), averaged over DP ranks; megatron's tracker is cleared for
    the next step. Every rank gets the same numbers. Empty for a dense model or a zero coefficient."""
    if not spec.is_moe:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name, metric in _TRACKED.items():
        have = torch.tensor([float(name in tracker)], device=device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)       # every rank takes part, or none
        if not have.item():
            continue
        # values[layer] sums this rank's micro-batches; each stage fills its own layers.
        values = tracker[name]["values"].detach().double().to(device).clone()
        calls = torch.tensor([float(calls)], dtype=torch.float64, device=device)
        if layout.pp > 1:
            dist.all_reduce(values, group=state.pp_group())
        dist.all_reduce(values, group=state.dp_group())
        dist.all_reduce(calls, group=state.dp_group())
        out[f"{prefix}/{metric}"] = float(values[:spec.num_layers].sum() / spec.num_layers
                                          / calls.clamp(min=1))
    clear_aux_losses_tracker()
    return out
