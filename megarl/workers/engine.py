"""MegatronEngine: one role's model shards on this rank, run through megatron's pipeline schedule.

The actor, critic and reference are thin layers over it (megarl/workers/{actor,critic,reference}.py):

    eng = MegatronEngine(EngineSpec(path, tp=2, pp=2, head="lm", trainable=True, optim=cfg))
    rows = eng.forward_rows(batch, micro=4, process=fn)           # forward-only, full batch back
    metrics = eng.train(batch, mini=16, micro=4, epochs=1, process=fn, loss_fn=loss, prefix="actor")

Gradient contract of `train`: the gradient applied after a mini-batch is the plain sum, over
every micro-batch on every DP rank, of d(loss_i). Megatron would otherwise divide each loss by
the micro-batch count and average over DP; `calculate_per_token_loss=True` (build.py) makes DDP
sum, and `_finalize_grads` drops the schedule's token-count division. Loss functions normalise
themselves with meta_info["global_tokens"] / ["global_seqs"], so token-mean is exact whatever
the micro-batching and DP size.

How a batch is cut (megarl/workers/batching.py: plan) and laid out (megarl/workers/packing.py):
`micro` rows per micro-batch, or with `max_tokens` as many as fit that token budget; rows packed
back to back (THD, EngineSpec.packing) or right-padded. The LM head is applied by the log-prob
code chunk by chunk (megarl/workers/logprob.py: linear_log_probs), so the model hands back hidden
states and full logits never exist.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from megarl.models import mcore
from megarl.models.build import build_gpt, transformer_config
from megarl.models.context_parallel import gather_sequence, split_sequence
from megarl.models.convert import (assemble, expert_of, hf_slices, megatron_names, megatron_to_hf, to_global,
                                   to_local)
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.parallel import cpu_compat, sequence, state
from megarl.protocol import DataProto
from megarl.workers import batching, packing
from megarl.workers.logprob import hidden_to_head
from megarl.workers.preflight import EngineSpec, read_spec, resolve_dtype
from megarl.workers.moe import moe_loss_scale, moe_metrics
from megarl.workers.optim import apply_schedule, build_optimizer, optimizer_step

log = logging.getLogger("megarl.workers")

# process(model_output, micro_batch) -> dict of [b, R] tensors (with grad when training)
Process = Callable[[torch.Tensor, DataProto], dict]
LossFn = Callable[[dict, DataProto], tuple]


class EngineShardView:
    """What the checkpoint engine reads from a worker that owns a MegatronEngine (`self.engine`)."""

    @property
    def spec(self):
        return self.engine.spec

    @property
    def model_chunks(self) -> list:
        """This rank's unwrapped GPTModel stage(s), one per virtual-pipeline chunk, with their
        weights on the device."""
        self.engine.onload()
        return self.engine.models

    @property
    def layer_offsets(self) -> list[int]:
        """Global index of each chunk's first layer."""
        return self.engine.offsets

    @property
    def layer_offset(self) -> int:
        return self.engine.layer_offset


class MegatronEngine:
    def __init__(self, es: EngineSpec):
        self.es = es
        self.dtype = resolve_dtype(es.dtype, es.trainable)
        self.spec, ckpt, self.hf_dtype = read_spec(es)  # hf_dtype: what exports write back
        state.init_distributed(es.timeout_s)
        self._build(ckpt)

    @cpu_compat.scoped
    def _build(self, ckpt: HFCheckpoint | None) -> None:
        es = self.es
        mcore.require()
        self.layout = state.init_model_parallel(es.tp, es.pp, es.seed, cp=es.cp, vpp=es.vpp, ep=es.ep)
        self.device = state.device()
        self.config = transformer_config(self.spec, es.tp, es.pp, self.dtype, sequence_parallel=es.sequence_parallel,
                                         recompute=es.recompute, overrides=es.transformer_overrides,
                                         cp=es.cp, vpp=es.vpp, ep=es.ep, etp=es.etp)
        # MoE: this expert-parallel rank holds global experts [expert_offset, + num_experts / EP).
        self.expert_offset = self.layout.ep_rank * (self.spec.num_experts // self.layout.ep)
        self.models, self.offsets = self._build_chunks()
        for m in self.models:  # the LM head is applied by the log-prob code (logprob.linear_log_probs)
            if es.head == "lm" and m.post_process:
                hidden_to_head(m.output_layer, self.config.sequence_parallel)
        self.packed = es.packing and es.cp == 1   # CP attention splits padded rows only
        self.tokens = [0, 0]  # (computed, real) since the last take_padding()
        self._check_names()
        if ckpt is not None:
            self.load_hf(ckpt)
        self.chunks = [self._wrap(m) for m in self.models]
        self.optimizer = None
        self.sched_step = 0
        if es.trainable:
            self.optimizer = build_optimizer(self.chunks, es.optim, self.dtype, es.use_distributed_optimizer)
            apply_schedule(self.optimizer, 0, es.optim)
            self.config.finalize_model_grads_func = _finalize_grads
            if self.dtype == torch.float16:
                self.config.grad_scale_func = self.optimizer.scale_loss
        else:
            for p in self.parameters():
                p.requires_grad_(False)
        self.offloaded, self.stash = False, None
        self.moe_calls = 0  # micro-batches since the last moe_metrics() (MoE router-loss averages)
        if es.dist_checkpoint:
            from megarl.workers.checkpoint import load_checkpoint
            load_checkpoint(es.dist_checkpoint, self, with_optimizer=False)

    # -- construction helpers ----------------------------------------------------------------------
    def _build_chunks(self) -> tuple[list, list[int]]:
        """This rank's model: one GPTModel per virtual-pipeline chunk (one without VPP), each
        with the global index of its first layer. Chunk v of stage p holds the layers of virtual
        stage v*PP + p (megatron's interleaved order)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        models, offsets = [], []
        for v in range(self.layout.vpp):
            vp = v if self.layout.vpp > 1 else None
            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            model = build_gpt(self.spec, self.config, first, last, self.es.head, vp_stage=vp)
            models.append(model.to(self.device))
            offsets.append(get_transformer_layer_offset(self.config, vp_stage=vp))
        return models, offsets

    @property
    def model(self):
        """The model of this rank when it holds one chunk (no virtual pipeline)."""
        if len(self.models) != 1:
            raise RuntimeError("this engine holds several virtual-pipeline chunks; use engine.models")
        return self.models[0]

    @property
    def layer_offset(self) -> int:
        return self.offsets[0]

    def parameters(self):
        for m in self.models:
            yield from m.parameters()

    def named_global_parameters(self):
        """(global megatron name, parameter) over every chunk of this rank."""
        for m, off in zip(self.models, self.offsets):
            for local, p in m.named_parameters():
                yield to_global(local, off, self.expert_offset), p

    def _wrap(self, model):
        from megatron.core.transformer.module import Float16Module
        if self.dtype != torch.float32:
            model = Float16Module(self.config, model)
        if not self.es.trainable:
            return model
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=self.es.use_distributed_optimizer)
        return DistributedDataParallel(self.config, ddp, model)

    def _check_names(self) -> None:
        """The model's parameters are exactly the ones convert.py maps (guards a megatron change)."""
        got = {n for n, _ in self.named_global_parameters()}
        want = set()
        for model, off in zip(self.models, self.offsets):
            layers = range(off, off + len(model.decoder.layers))
            want |= set(megatron_names(self.spec, layers, model.pre_process, model.post_process, self.es.head,
                                       self.experts))
        if got != want:
            raise RuntimeError(f"megatron parameter names differ from megarl's map: extra {sorted(got - want)[:3]}, "
                               f"missing {sorted(want - got)[:3]}")

    def head_weight(self) -> torch.Tensor:
        """This TP rank's vocabulary rows of the LM head (the embedding when tied), last stage."""
        m = self.models[-1]  # the last (virtual) stage holds the head
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    def take_padding(self) -> tuple[int, int]:
        """(tokens computed, real tokens) over every pass since the last call; resets them."""
        out, self.tokens = tuple(self.tokens), [0, 0]
        return out

    @property
    def experts(self) -> range:
        """The global experts this rank holds (MoE; empty for a dense model)."""
        return range(self.expert_offset, self.expert_offset + self.spec.num_experts // self.layout.ep)

    @property
    def layers(self) -> list[int]:
        """Global indices of the layers on this rank (every chunk)."""
        return [off + i for m, off in zip(self.models, self.offsets) for i in range(len(m.decoder.layers))]

    def load_hf(self, ckpt: HFCheckpoint) -> None:
        """Copy this rank's slices of the HF checkpoint into its shard (reads only those bytes)."""
        head = self.es.head
        with torch.no_grad():
            for name, param in self.named_global_parameters():
                if head == "value" and name == "output_layer.weight" and not self.es.head_from_checkpoint:
                    param.zero_()  # a fresh value head predicts 0 until the critic learns
                    continue
                pieces = {s.hf_name: ckpt.read(s) for s in hf_slices(name, self.spec, self.layout.tp_rank,
                                                                      self.layout.tp, head)}
                shard = assemble(name, pieces, self.spec, self.layout.tp_rank, self.layout.tp, head)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: built a shard of shape {list(shard.shape)} for a parameter of "
                                     f"shape {list(param.shape)}")
                param.copy_(shard)

    def hf_tensors(self):
        """(HF name, full tensor) for this pipeline stage, TP shards all-gathered (every TP rank
        yields the same; at TP=1 some are views of the live weights). A simple exporter; the
        checkpoint engine plans its own transfers."""
        return self._hf_named(lambda p: p.detach())

    def _hf_named(self, value):
        self.onload()
        group = state.tp_group()
        for name, param in self.named_global_parameters():
            mine = value(param).contiguous()
            shards = [mine]
            if self.layout.tp > 1:
                shards = [torch.empty_like(mine) for _ in range(self.layout.tp)]
                dist.all_gather(shards, mine, group=group)
            if self.layout.ep > 1 and expert_of(name) is not None:
                # Every EP rank holds its experts under the same local names, in the same order:
                # gather each over the EP group and yield all of them (rank r's is r * E/EP + i).
                per = self.spec.num_experts // self.layout.ep
                stacked = torch.stack(shards)
                parts = [torch.empty_like(stacked) for _ in range(self.layout.ep)]
                dist.all_gather(parts, stacked, group=state.ep_group())
                for r, part in enumerate(parts):
                    other = to_global(to_local(name, 0, self.expert_offset), 0, r * per)
                    yield from megatron_to_hf(other, list(part.unbind(0)), self.spec, self.es.head)
                continue
            yield from megatron_to_hf(name, shards, self.spec, self.es.head)

    # -- the pipeline schedule ----------------------------------------------------------------------
    def _columns(self, plan: list[list[list[int]]], lengths: list[int], seq: int, dynamic: bool,
                 real_rows: int | None = None) -> list[list[int]]:
        """Per DP rank, the columns of each micro-batch (packing.widths); counts the run's tokens
        (rows past `real_rows` are repeats that only even out the shapes: computed, not real)."""
        if dynamic and self.layout.pp > 1 and not self.packed:
            raise ValueError("token-budget micro-batches under pipeline parallelism need packed sequences "
                             "(model.use_remove_padding=true): padded ones of different row counts cannot share "
                             "the pipeline's fixed shape")
        common = self.layout.pp > 1 or (not self.packed and not dynamic)  # fixed shapes between stages
        lens = [[[lengths[i] for i in mb] for mb in rank] for rank in plan]
        cols = [self._round(packing.widths(rank, self.packed, seq, common)) for rank in lens]
        if self.spec.is_moe and self.layout.ep > 1:
            # megatron's all-gather dispatcher gathers every EP rank's tokens: micro-batch i must
            # have one shape on every DP rank (packed: [1, T]; static padding: equal rows of `seq`).
            if dynamic and not self.packed:
                raise ValueError("token-budget micro-batches under expert parallelism need packed sequences "
                                 "(model.use_remove_padding=true)")
            top = [max(rank[i] for rank in cols) for i in range(len(cols[0]))]
            cols = [list(top) for _ in cols]
        computed = sum(w if self.packed else w * len(ls)
                       for rank_cols, rank_lens in zip(cols, lens) for w, ls in zip(rank_cols, rank_lens))
        self.tokens[0] += computed
        self.tokens[1] += sum(lengths[:real_rows])
        return cols

    def _round(self, widths: list[int]) -> list[int]:
        """Widths rounded up to what sequence / context parallelism split evenly (the tail is
        padding no real position attends to)."""
        lay = self.layout
        return [sequence.padded_length(w, lay.tp if self.config.sequence_parallel else 1, lay.cp) for w in widths]

    def _share(self, data: DataProto, rank_plan: list[list[int]]) -> list[DataProto]:
        """This DP rank's micro-batches: its rows move to the model's device once, then are cut
        (every micro-batch, and the loss, sees device tensors)."""
        local = data[[i for mb in rank_plan for i in mb]].to(self.device)
        out, at = [], 0
        for mb in rank_plan:
            out.append(local[at:at + len(mb)])
            at += len(mb)
        return out

    def _run(self, micro: list[DataProto], cols: list[int] | int, process: Process,
             loss_fn: LossFn | None) -> list[dict]:
        """Run `micro` (micro-batch i `cols[i]` columns wide; an int: the padded width `seq`, one
        shape for all) through megatron's schedule; forward-only when loss_fn is None. Returns, on
        the last stage, one dict per micro-batch (outputs, or loss metrics); [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

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
            out = model(ids, pos, None, packed_seq_params=inp.packed_seq_params, **extra, **moe)
            return out, partial(self._last_stage, mb, process, loss_fn, cp_group)

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

    @staticmethod
    def _last_stage(mb: DataProto, process: Process, loss_fn: LossFn | None, cp_group, output: torch.Tensor):
        # output [b, s, ...]: under CP this rank's two sequence chunks; every CP rank then computes
        # the loss over the whole sequence, and each keeps the gradient of its own positions.
        # (mb.batch["out_index"] addresses the whole padded width, so nothing is cut here.)
        output = gather_sequence(output, cp_group, dim=1, sum_grads=False)
        outs = process(output, mb)
        one = torch.ones((), dtype=torch.int, device=output.device)
        if loss_fn is None:
            return torch.zeros((), device=output.device), one, {k: v.detach() for k, v in outs.items()}
        loss, metrics = loss_fn(outs, mb)
        # detach first: float() of a tensor that requires grad warns on every micro-batch
        metrics = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in (metrics or {}).items()}
        return loss, one, {"_loss": float(loss.detach()), **metrics}

    # -- forward only -------------------------------------------------------------------------------
    @cpu_compat.scoped
    @torch.no_grad()
    def forward_rows(self, data: DataProto, micro: int, process: Process, keys: tuple[str, ...],
                     tails: dict[str, tuple] | None = None, max_tokens: int | None = None) -> dict:
        """Forward the full batch (every rank passes the same one); returns {key: [B, *tail]} on
        every rank (tail defaults to (R,)). Micro-batches of `micro` rows, or with `max_tokens` of
        as many as fit that budget. Rows are padded up to a multiple of DP (x micro) for even
        shapes, then dropped."""
        batching.check_batch(data)
        self.onload()
        lay = self.layout
        # The interleaved (VPP) schedule needs a multiple of PP micro-batches.
        padded, n = batching.pad_rows(data, lay.dp * (1 if max_tokens else micro * (lay.pp if lay.vpp > 1 else 1)))
        lengths = batching.row_tokens(padded)
        plan = batching.plan(lengths, lay.dp, micro, max_tokens, self.packed)
        cols = self._columns(plan, lengths, batching.seq_len(padded), max_tokens is not None, n)
        for c in self.chunks:
            c.eval()
        got = self._run(self._share(padded, plan[lay.dp_rank]), cols[lay.dp_rank], process, None)
        R = data.batch["responses"].shape[1]
        tails = {k: (tails or {}).get(k, (R,)) for k in keys}
        rows = {k: torch.cat([g[k] for g in got]).float() for k in keys} if got else {}
        rows = self._share_rows(rows, len(padded) // lay.dp, tails)
        # Rows come back in plan order (DP rank, micro-batch, row); put them back in batch order.
        order = torch.tensor([i for rank in plan for mb in rank for i in mb])
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return {k: v[back][:n] for k, v in rows.items()}

    @cpu_compat.scoped
    def logits(self, input_ids: torch.Tensor, micro: int = 1) -> torch.Tensor:
        """Full-vocabulary logits [B, S, V] (fp32) of unpadded token rows, on every rank (checks)."""
        from megarl.workers.outputs import full_logits
        B, S = input_ids.shape
        data = DataProto.from_dict({"input_ids": input_ids, "prompt_lens": torch.full((B,), S),
                                    "response_lens": torch.zeros(B, dtype=torch.long),
                                    "responses": torch.zeros(B, 1, dtype=torch.long)})
        group, vocab = state.tp_group(), self.spec.vocab_size
        rows = self.forward_rows(data, micro, lambda out, mb: {"logits": full_logits(out, self.head_weight(), vocab,
                                                                                     group, mb)},
                                 ("logits",), {"logits": (S, vocab)})
        return rows["logits"]

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

    # -- training -------------------------------------------------------------------------------------
    @cpu_compat.scoped
    def train(self, data: DataProto, mini: int, micro: int, epochs: int, process: Process, loss_fn: LossFn,
              prefix: str, shuffle: bool = False, max_tokens: int | None = None) -> dict[str, float]:
        """`epochs` passes over mini-batches of `mini` sequences, one optimizer step each; one
        LR-schedule step per call. The loss function's metrics are means over its micro-batch
        (verl's convention, so a user's loss function needs no knowledge of the split): they are
        averaged over every micro-batch of every DP rank, mini-batch and epoch."""
        if not self.es.trainable:
            raise RuntimeError("this model is frozen")
        batching.check_batch(data, need_mask=True)
        self.onload()
        lay = self.layout
        if len(data) % mini:
            raise ValueError(f"{len(data)} sequences do not split into mini-batches of {mini} "
                             "(ppo_mini_batch_size x rollout.n); make the batch a multiple of it")
        if mini % (lay.dp * (1 if max_tokens else micro)):
            raise ValueError(f"a mini-batch of {mini} sequences does not split into DP {lay.dp} x micro-batches of "
                             f"{micro}; change ppo_micro_batch_size_per_gpu")
        if lay.vpp > 1 and (mini // (lay.dp * micro)) % lay.pp:
            raise ValueError(f"virtual pipeline: {mini // (lay.dp * micro)} micro-batches per mini-batch is not a "
                             f"multiple of PP {lay.pp} (megatron's interleaved schedule); change "
                             "ppo_micro_batch_size_per_gpu")
        seq = batching.seq_len(data)
        for c in self.chunks:
            c.train()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        skipped, norms = 0, []
        lr = self.optimizer.param_groups[0]["lr"]
        for epoch in range(epochs):
            order = data
            if shuffle:
                g = torch.Generator().manual_seed(self.es.seed + 1000 * self.sched_step + epoch)
                order = data[torch.randperm(len(data), generator=g)]
            for mb_data in order.split(mini):
                got = self.accumulate(mb_data, micro, process, loss_fn, seq, max_tokens)
                applied, norm = self.step(got)
                if not applied:
                    skipped += 1
                    log.warning("%s: skipped an optimizer step (loss or grad norm not finite: %s)", prefix, norm)
                else:
                    norms.append(norm)
                for g in got:
                    for k, v in g.items():
                        if not k.startswith("_"):
                            sums[k] = sums.get(k, 0.0) + v
                            counts[k] = counts.get(k, 0) + 1
        metrics = self._mean_metrics(sums, counts)
        metrics.update(moe_metrics(self, prefix))
        metrics.update({f"{prefix}/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
                        f"{prefix}/lr": lr, f"{prefix}/skipped_steps": float(skipped)})
        self.sched_step += 1
        apply_schedule(self.optimizer, self.sched_step, self.es.optim)
        return metrics

    @cpu_compat.scoped
    def accumulate(self, mini_batch: DataProto, micro: int, process: Process, loss_fn: LossFn,
                   seq: int | None = None, max_tokens: int | None = None) -> list[dict]:
        """Fresh gradients of one mini-batch (the whole one; every rank passes the same): this DP
        rank's share in micro-batches (`micro` rows, or by the `max_tokens` budget) through the
        schedule, DP-summed. Returns the last stage's per-micro-batch metrics."""
        self.onload()
        lay = self.layout
        lengths = batching.row_tokens(mini_batch)
        plan = batching.plan(lengths, lay.dp, micro, max_tokens, self.packed)
        cols = self._columns(plan, lengths, seq or batching.seq_len(mini_batch), max_tokens is not None)
        meta = {"global_tokens": float(mini_batch.batch["response_mask"].sum()), "global_seqs": len(mini_batch),
                "global_micro_batches": sum(len(rank) for rank in plan)}
        parts = self._share(mini_batch, plan[lay.dp_rank])
        for p in parts:
            p.meta_info.update(meta)
        for c in self.chunks:
            c.zero_grad_buffer()
        self.moe_calls += len(parts)
        with moe_loss_scale(self, meta["global_micro_batches"]):
            return self._run(parts, cols[lay.dp_rank], process, loss_fn)

    @cpu_compat.scoped
    def step(self, got: list[dict]) -> tuple[bool, float]:
        """Clip and apply the accumulated gradients, unless a loss (any rank's) or the norm is not finite."""
        bad = torch.tensor(float(any(not math.isfinite(g["_loss"]) for g in got)), device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return optimizer_step(self.optimizer, self.es.optim.clip_grad, bool(bad))

    def hf_grads(self):
        """(HF name, full accumulated gradient) for this stage, like hf_tensors (checks and debugging)."""
        return self._hf_named(lambda p: p.main_grad.clone())

    def _mean_metrics(self, sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
        """Mean of each metric over the micro-batches of all DP ranks (the last stages hold them);
        every rank gets the result."""
        payload = [(sums, counts) if self.layout.is_last_stage else None]
        if self.layout.pp > 1:
            dist.broadcast_object_list(payload, src=state.pp_last_rank(), group=state.pp_group())
        gathered = [None] * self.layout.dp
        dist.all_gather_object(gathered, payload[0], group=state.dp_group())
        keys = sorted({k for s, _ in gathered for k in s})
        return {k: sum(s.get(k, 0.0) for s, _ in gathered) / max(sum(c.get(k, 0) for _, c in gathered), 1)
                for k in keys}

    # -- memory -------------------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        # DDP's flat param buffers (distributed optimizer) share storage with the params: one copy moves
        return list(self.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        if not self.es.trainable:
            return []
        return [b.grad_data for c in self.chunks for b in c.buffers + c.expert_parallel_buffers
                if b.grad_data is not None]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Adam moments and (mixed precision) fp32 master weights; with fp32 weights the masters
        are the weights themselves, so they move with the optimizer."""
        if self.optimizer is None:
            return []
        from megarl.workers.optim import CPUAdamW, _megatron_parts
        parts = [self.optimizer.optimizer] if isinstance(self.optimizer, CPUAdamW) else \
            [getattr(o, "optimizer", None) for o in _megatron_parts(self.optimizer)]
        out = []
        for opt in filter(None, parts):
            out += [p for g in opt.param_groups for p in g["params"]]
            out += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return [t for t in out if t.device.type == self.device.type]

    def resident_bytes(self) -> int:
        """Device bytes this role holds now in weights, grad buffers and optimizer state."""
        from megarl.workers.offload import resident_bytes
        return resident_bytes(self.param_tensors() + self.grad_tensors() + self.optimizer_tensors(), self.device)

    @cpu_compat.scoped
    def offload(self, params: bool = True, grads: bool = False, optimizer: bool = False) -> int:
        """Move the chosen state to host memory until `onload` (the next forward, update or save
        calls it); returns the bytes moved. Gradient buffers are freed, not copied: every
        mini-batch starts by zeroing them. On CUDA the caching allocator is emptied afterwards,
        so the rollout engine can take the memory."""
        from megarl.workers.offload import HostStash
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stash = self.stash if self.offloaded else HostStash()
        done: set[int] = set()
        for on, tensors, keep in ((params, self.param_tensors, True), (optimizer, self.optimizer_tensors, True),
                                  (grads, self.grad_tensors, False)):
            if on:
                done |= stash.offload(tensors(), keep=keep, skip=done)
        self.stash, self.offloaded = stash, bool(stash)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return stash.nbytes

    @cpu_compat.scoped
    def onload(self) -> None:
        if self.offloaded:
            self.stash.onload()
            self.offloaded = False


def _finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads without the division by the schedule's token count."""
    from megatron.core.distributed import finalize_model_grads
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
