"""Schedule: a batch cut into micro-batches and run through megatron's pipeline schedule. Part
of MegatronEngine (megarl/workers/engine.py).

    sched = Schedule(shards, chunks, packed=True)
    run = sched.forward_rows(batch, micro=4, process=fn, keys=("log_probs",))   # run.rows: {key: [B, R]}
    run = sched.accumulate(mini_batch, micro=4, process=fn, loss_fn=loss)       # run.outputs: metrics
    run.padding                                          # Padding(computed, real) tokens of this run

Every per-token tensor of the batch (input ids, masks, routes, versions...) is cut by the same
code: batching.plan picks the rows of each micro-batch, `_share` slices the whole DataProto, and
packing.micro_inputs lays the rows out; a new per-token key needs no special case here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.models.context_parallel import gather_sequence, split_sequence
from megarl.models.routing_replay import KEY, check_routes, route_dtype
from megarl.parallel import cpu_compat, sequence, state
from megarl.protocol import DataProto
from megarl.workers import batching, packing
from megarl.workers.moe import moe_loss_scale
from megarl.workers.routes import RouteRun

# process(model_output, micro_batch) -> dict of [b, R] tensors (with grad when training)
Process = Callable[[torch.Tensor, DataProto], dict]
LossFn = Callable[[dict, DataProto], tuple]


@dataclass(frozen=True)
class Padding:
    """Tokens the model computed and the real ones among them (the rest is padding)."""
    computed: int = 0
    real: int = 0

    def __add__(self, other: "Padding") -> "Padding":
        return Padding(self.computed + other.computed, self.real + other.real)


@dataclass
class Run:
    """What one pass returns: outputs (last stage; [] elsewhere), its padding, and how many
    micro-batches this rank ran."""
    padding: Padding
    micro_batches: int
    outputs: list[dict] = field(default_factory=list)
    rows: dict = field(default_factory=dict)


class Schedule(cpu_compat.Boundary):
    def __init__(self, shards, chunks: list, packed: bool):
        self.layout, self.device, self.dtype = shards.layout, shards.device, shards.dtype
        self.spec, self.config = shards.spec, shards.config
        self.chunks = chunks
        self.packed = packed            # THD rows back to back; CP attention splits padded rows only

    # -- forward only -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_rows(self, data: DataProto, micro: int, process: Process, keys: tuple[str, ...],
                     tails: dict[str, tuple] | None = None, max_tokens: int | None = None,
                     routes: str | None = None) -> Run:
        """Forward the full batch (every rank passes the same one); Run.rows is {key: [B, *tail]}
        on every rank (tail defaults to (R,)). Rows are padded up to a multiple of DP (x micro)
        for even shapes, then dropped. MoE routing replay (megarl/workers/routes.py): routes=
        "replay" follows the batch's routed_experts; "record" adds them to Run.rows."""
        lay = self.layout
        # The interleaved (VPP) schedule needs a multiple of PP micro-batches.
        padded, n = batching.pad_rows(data, lay.dp * (1 if max_tokens else micro * (lay.pp if lay.vpp > 1 else 1)))
        lengths = batching.row_tokens(padded)
        plan = batching.plan(lengths, lay.dp, micro, max_tokens, self.packed)
        cols, padding = self.columns(plan, lengths, batching.seq_len(padded), max_tokens is not None, n)
        for c in self.chunks:
            c.eval()
        route_run = self.route_run(routes, padded)
        try:
            got = self.run(self.share(padded, plan[lay.dp_rank]), cols[lay.dp_rank], process, None, route_run)
            recorded = self.recorded_routes(route_run, padded) if routes == "record" else None
        finally:
            if route_run is not None:
                route_run.close()
        R = data.batch["responses"].shape[1]
        tails = {k: (tails or {}).get(k, (R,)) for k in keys}
        rows = {k: torch.cat([g[k] for g in got]).float() for k in keys} if got else {}
        rows = self._share_rows(rows, len(padded) // lay.dp, tails)
        if recorded is not None:
            rows[KEY] = recorded
        # Rows come back in plan order (DP rank, micro-batch, row); put them back in batch order.
        order = torch.tensor([i for rank in plan for mb in rank for i in mb])
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return Run(padding, len(plan[lay.dp_rank]), rows={k: v[back][:n] for k, v in rows.items()})

    def _share_rows(self, rows: dict, local_rows: int, tails: dict[str, tuple]) -> dict:
        """Last stage -> every stage of the pipeline, then all-gather over DP (in DP-rank order,
        which is the row order dp_slice cut)."""
        out = {}
        for key in sorted(tails):
            t = rows[key].to(self.device).contiguous() if self.layout.is_last_stage else \
                torch.empty(local_rows, *tails[key], device=self.device)
            if self.layout.pp > 1:
                dist.broadcast(t, src=state.pp_last_rank(), group=state.pp_group())
            if self.layout.dp > 1:
                parts = [torch.empty_like(t) for _ in range(self.layout.dp)]
                dist.all_gather(parts, t, group=state.dp_group())
                t = torch.cat(parts)
            out[key] = t.cpu()
        return out

    # -- gradients ----------------------------------------------------------------------------------
    def accumulate(self, mini_batch: DataProto, micro: int, process: Process, loss_fn: LossFn,
                   seq: int | None = None, max_tokens: int | None = None, routes: str | None = None) -> Run:
        """Fresh gradients of one mini-batch (the whole one; every rank passes the same): this DP
        rank's share in micro-batches through the schedule, DP-summed. Run.outputs holds the
        last stage's per-micro-batch metrics."""
        lay = self.layout
        lengths = batching.row_tokens(mini_batch)
        plan = batching.plan(lengths, lay.dp, micro, max_tokens, self.packed)
        cols, padding = self.columns(plan, lengths, seq or batching.seq_len(mini_batch), max_tokens is not None)
        meta = {"global_tokens": float(mini_batch.batch["response_mask"].sum()), "global_seqs": len(mini_batch),
                "global_micro_batches": sum(len(rank) for rank in plan)}
        parts = self.share(mini_batch, plan[lay.dp_rank])
        for p in parts:
            p.meta_info.update(meta)
        for c in self.chunks:
            c.zero_grad_buffer()
        route_run = self.route_run(routes, mini_batch)
        try:
            with moe_loss_scale(self.config, self.spec, meta["global_micro_batches"]):
                return Run(padding, len(parts), outputs=self.run(parts, cols[lay.dp_rank], process, loss_fn, route_run))
        finally:
            if route_run is not None:
                route_run.close()

    # -- MoE routing replay ---------------------------------------------------------------------------
    def route_run(self, routes: str | None, data: DataProto) -> RouteRun | None:
        if routes is None:
            return None
        spec = self.spec
        if routes == "replay":
            if KEY not in data.batch:
                raise ValueError(f"routing replay needs batch['{KEY}'] (the rollout records it under R3, the "
                                 "old-policy pass under R2)")
            check_routes(data.batch[KEY], data.batch["input_ids"], spec.num_layers, spec.moe_topk, spec.num_experts)
        return RouteRun(self.chunks, self.layout, self.config.sequence_parallel, self.packed,
                        self.config.recompute_granularity is not None, routes)

    def recorded_routes(self, route_run: RouteRun, padded: DataProto) -> torch.Tensor:
        """The recorded routes of the whole batch [B, S, L, K] (route_dtype) on every rank, in the
        order of `padded`'s rows (the plan's order is undone by forward_rows, like its other rows)."""
        spec, lay = self.spec, self.layout
        local = route_run.recorded(spec.num_layers, spec.moe_topk, padded.batch["input_ids"].shape[1],
                                   route_dtype(spec.num_experts), self.device)
        if lay.dp > 1:
            parts = [torch.empty_like(local) for _ in range(lay.dp)]
            dist.all_gather(parts, local.contiguous(), group=state.dp_group())
            local = torch.cat(parts)
        return local.cpu()

    # -- cutting and running ------------------------------------------------------------------------
    def columns(self, plan: list[list[list[int]]], lengths: list[int], seq: int, dynamic: bool,
                real_rows: int | None = None) -> tuple[list[list[int]], Padding]:
        """Per DP rank, the columns of each micro-batch (packing.widths), and the run's tokens
        (rows past `real_rows` are repeats that only even out the shapes: computed, not real)."""
        lay = self.layout
        if dynamic and lay.pp > 1 and not self.packed:
            raise ValueError("token-budget micro-batches under pipeline parallelism need packed sequences "
                             "(model.use_remove_padding=true): padded ones of different row counts cannot share "
                             "the pipeline's fixed shape")
        common = lay.pp > 1 or (not self.packed and not dynamic)  # fixed shapes between stages
        lens = [[[lengths[i] for i in mb] for mb in rank] for rank in plan]
        cols = [self._round(packing.widths(rank, self.packed, seq, common)) for rank in lens]
        if self.spec.is_moe and lay.ep > 1:
            # megatron's all-gather dispatcher gathers every EP rank's tokens: micro-batch i must
            # have one shape on every DP rank (packed: [1, T]; static padding: equal rows of `seq`).
            if dynamic and not self.packed:
                raise ValueError("token-budget micro-batches under expert parallelism need packed sequences "
                                 "(model.use_remove_padding=true)")
            top = [max(rank[i] for rank in cols) for i in range(len(cols[0]))]
            cols = [list(top) for _ in cols]
        computed = sum(w if self.packed else w * len(ls)
                       for rank_cols, rank_lens in zip(cols, lens) for w, ls in zip(rank_cols, rank_lens))
        return cols, Padding(computed, sum(lengths[:real_rows]))

    def _round(self, widths: list[int]) -> list[int]:
        """Widths rounded up to what sequence / context parallelism split evenly (the tail is
        padding no real position attends to)."""
        lay = self.layout
        return [sequence.padded_length(w, lay.tp if self.config.sequence_parallel else 1, lay.cp) for w in widths]

    def share(self, data: DataProto, rank_plan: list[list[int]]) -> list[DataProto]:
        """This DP rank's micro-batches: its rows move to the model's device once, then are cut
        (every micro-batch, and the loss, sees device tensors)."""
        local = data[[i for mb in rank_plan for i in mb]].to(self.device)
        out, at = [], 0
        for mb in rank_plan:
            out.append(local[at:at + len(mb)])
            at += len(mb)
        return out

    def run(self, micro: list[DataProto], cols: list[int] | int, process: Process,
            loss_fn: LossFn | None, route_run: RouteRun | None = None) -> list[dict]:
        """Run `micro` (micro-batch i `cols[i]` columns wide; an int: the padded width `seq`, one
        shape for all) through megatron's schedule; forward-only when loss_fn is None. Returns, on
        the last stage, one dict per micro-batch (outputs, or loss metrics); [] elsewhere."""
        lay = self.layout
        for mb in micro:
            batching.check_device(mb, self.device)
        if isinstance(cols, int):
            lens = [batching.row_tokens(mb) for mb in micro]
            cols = self._round(packing.widths(lens, self.packed, cols, common=True))
        inputs = packing.micro_inputs(micro, self.packed, cols)
        for mb, inp in zip(micro, inputs):  # where the outputs for each row sit (outputs.py reads them)
            mb.batch["out_index"], mb.batch["last_index"] = inp.out_index, inp.last_index
        # Float16Module would upcast the whole [b, s, h] output to fp32; the log-prob code upcasts per chunk.
        extra = {"fp32_output": False} if self.dtype != torch.float32 else {}
        cp_group = state.cp_group() if lay.cp > 1 else None

        def forward_step(it, model):
            mb, inp = next(it)
            inp = inp.to(self.device)
            ids, pos = inp.input_ids, inp.position_ids
            if lay.cp > 1:  # padded rows only (packing is off under CP)
                ids, pos = (split_sequence(t, lay.cp_rank, lay.cp, dim=1) for t in (ids, pos))
            moe = {"padding_mask": self._padding_mask(mb, inp)} if self.spec.is_moe else {}
            if route_run is not None:
                route_run.before(model, mb, inp)
            out = model(ids, pos, None, packed_seq_params=inp.packed_seq_params, **extra, **moe)
            if route_run is not None:
                route_run.after(model, mb, inp, out)
            return out, partial(_last_stage, mb, process, loss_fn, cp_group)

        # The interleaved (virtual pipeline) schedule reads one iterator per model chunk.
        pairs = list(zip(micro, inputs))
        data = [iter(pairs) for _ in self.chunks] if len(self.chunks) > 1 else iter(pairs)
        first = inputs[0].input_ids.shape
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=self.chunks,
            num_microbatches=len(micro), seq_length=first[1], micro_batch_size=first[0],
            forward_only=loss_fn is None)

    def _padding_mask(self, mb: DataProto, inp) -> torch.Tensor:
        """True where a column is padding: MoE routers keep it out of their aux/z losses (as HF's
        attention mask does); without it the pad token's embedding gets large aux-loss gradients."""
        lens = (mb.batch["prompt_lens"] + mb.batch["response_lens"]).to(self.device)
        cols = torch.arange(inp.input_ids.shape[1], device=self.device)
        if inp.packed_seq_params is not None:    # rows back to back, bucket padding at the tail
            return (cols >= lens.sum()).unsqueeze(0)
        return cols.unsqueeze(0) >= lens.unsqueeze(1)


def _last_stage(mb: DataProto, process: Process, loss_fn: LossFn | None, cp_group, output: torch.Tensor):
    # output [b, s, ...]: under CP this rank's two sequence chunks; every CP rank then computes
    # the loss over the whole sequence, and each keeps the gradient of its own positions.
    # (mb.batch["out_index"] addresses the whole padded width, so nothing is cut here.)
    # It runs inside the schedule, so inside the caller's cpu_compat scope.
    output = gather_sequence(output, cp_group, dim=1, sum_grads=False)
    outs = process(output, mb)
    one = torch.ones((), dtype=torch.int, device=output.device)
    if loss_fn is None:
        return torch.zeros((), device=output.device), one, {k: v.detach() for k, v in outs.items()}
    loss, metrics = loss_fn(outs, mb)
    # detach first: float() of a tensor that requires grad warns on every micro-batch
    metrics = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in (metrics or {}).items()}
    return loss, one, {"_loss": float(loss.detach()), **metrics}
