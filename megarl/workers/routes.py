"""Routing replay inside the engine's passes: megatron's RouterReplay on one model's routers.

    run = RouteRun(chunks, layout, sp=True, packed=True, recompute=False, action="replay")
    run.before(chunk, mb, inp)     # forward_step, before model(...): this micro-batch's targets
    run.after(chunk, out)          # after model(...): record, or arm the recompute switch
    rows = run.recorded(...)       # "record": [B_local, S, L, K] of this DP rank's rows, whole
    run.close()                    # always: actions and indices cleared, nothing leaks

megatron-core 0.16.1 (`transformer/moe/router_replay.py`) gives each router a RouterReplay when
TransformerConfig.moe_enable_routing_replay is set, and keeps every instance in a class-level
list; megarl builds the actor and the reference in one process, so it drives each model's
routers through that model's own modules and never the list. Per router:
  * REPLAY_FORWARD top-k = the target set before the forward; the scores (softmax or pre-softmax)
    are still gathered from the live logits, so the router weights get gradients.
  * set_target_indices also appends to `replay_backward_list`, which REPLAY_BACKWARD pops in
    order: megatron re-runs a layer's forward inside backward under activation recompute, and
    the schedule runs backwards in forward order (1F1B and the no-pipeline schedule alike, per
    chunk under VPP). Without recompute nothing pops it, so the entry is dropped at once; with
    it, a hook on the chunk's output switches the routers to REPLAY_BACKWARD when that
    micro-batch's backward starts (the next forward switches back).
  * RECORD keeps the last forward's top-k; `after` copies it out per micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.models import routing_replay as rr
from megarl.models.context_parallel import split_sequence
from megarl.parallel import state


def routers(model: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
    """(global MoE layer index, RouterReplay) of each router in this model chunk, in layer order.
    megatron numbers layers from 1 across pipeline stages and VPP chunks; megarl's MoE models
    have no dense layers (ModelSpec), so layer_number - 1 is the MoE layer."""
    out = []
    for m in model.modules():
        if isinstance(m, Router):
            if m.router_replay is None:
                raise RuntimeError("this model was built without moe_enable_routing_replay; routing replay needs "
                                   "EngineSpec.routing_replay "
                                   "(megarl/models/families/base.py MoeMlp.transformer_config)")
            out.append((m.layer_number - 1, m.router_replay))
    return sorted(out, key=lambda pair: pair[0])


class RouteRun:
    def __init__(self, chunks: list, layout, sp: bool, packed: bool, recompute: bool, action: str):
        if action not in ("replay", "record"):
            raise ValueError(f"action must be 'replay' or 'record', got {action!r}")
        self.layout, self.packed, self.recompute, self.action = layout, packed, recompute, action
        self.sp_rank, self.sp = (layout.tp_rank, layout.tp) if sp else (0, 1)
        self.routers = {id(c): routers(c) for c in chunks}
        self.records: list[tuple] = []      # (micro-batch, cols, {layer: [tokens, K]}) in forward order
        self._seen: dict[int, int] = {}     # chunk -> micro-batches it ran (VPP: one count per chunk)

    def before(self, chunk, mb, inp) -> None:
        if self.action == "record":
            for _, r in self.routers[id(chunk)]:
                r.set_router_replay_action(RouterReplayAction.RECORD)
            return
        lens = mb.batch["prompt_lens"] + mb.batch["response_lens"]
        micro = rr.micro_routes(mb.batch[rr.KEY], lens, self.packed, inp.input_ids.shape[1])
        micro = split_sequence(micro, self.layout.cp_rank, self.layout.cp, dim=1)
        for layer, r in self.routers[id(chunk)]:
            r.set_target_indices(rr.local_tokens(micro, layer, self.sp_rank, self.sp))
            if not self.recompute:
                r.replay_backward_list.pop()   # read only by a forward recomputed in backward
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after(self, chunk, mb, inp, out: torch.Tensor) -> None:
        pairs = self.routers[id(chunk)]
        if self.action == "record":
            n = self._seen.get(id(chunk), 0)
            self._seen[id(chunk)] = n + 1
            got = {layer: r.get_recorded_indices().to(torch.int16) for layer, r in pairs}  # 2 bytes a slot
            self.records.append((id(chunk), n, mb, inp.input_ids.shape[1], got))
        elif self.recompute and out.requires_grad:
            def to_backward(grad):
                for _, r in pairs:
                    r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                return grad
            out.register_hook(to_backward)

    def recorded(self, num_layers: int, topk: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
        """This DP rank's rows' routes [rows, width, L, K] from every stage, TP (SP) and CP rank,
        in the micro-batch order of the run (a sum over those groups: each position and layer is
        recorded by exactly one of them; without SP every TP rank holds the same, and rank 0's
        counts)."""
        lay = self.layout
        per_mb: dict[int, torch.Tensor] = {}
        keep = self.sp > 1 or lay.tp_rank == 0
        for _, n, mb, cols, got in self.records:
            b = 1 if self.packed else len(mb)
            local_cols = cols // lay.cp
            buf = per_mb.get(n)
            if buf is None:
                buf = torch.zeros(b, local_cols, num_layers, topk, dtype=torch.int32, device=device)
                per_mb[n] = buf
            if keep:
                for layer, idx in got.items():
                    rr.place_tokens(idx, buf, layer, self.sp_rank, self.sp)
        rows = []
        for n in sorted(per_mb):
            mb = next(rec[2] for rec in self.records if rec[1] == n)
            full = rr.place_sequence(per_mb[n], lay.cp_rank, lay.cp, dim=1)
            lens = mb.batch["prompt_lens"] + mb.batch["response_lens"]
            rows.append(rr.unpack_rows(full, lens, self.packed, width))
        out = torch.cat(rows) if rows else torch.zeros(0, width, num_layers, topk, dtype=torch.int32, device=device)
        for group, size in ((state.pp_group, lay.pp), (state.cp_group, lay.cp), (state.tp_group, lay.tp)):
            if size > 1:
                dist.all_reduce(out, group=group())
        return out.to(dtype)

    def close(self) -> None:
        for pairs in self.routers.values():
            for _, r in pairs:
                r.clear_indices()
                r.clear_router_replay_action()
        self.records = []
