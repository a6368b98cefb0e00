"""Shards: one role's megatron model chunks on this rank, built from a ModelSpec, filled from a
HF checkpoint and exported back to HF names. Part of MegatronEngine (megarl/workers/engine.py).

    shards = Shards(es, spec, dtype)          # sets up megatron's layout, builds the chunk(s)
    shards.load_hf(HFCheckpoint(path))        # this rank's slices only
    chunks = shards.wrap()                    # Float16Module / DDP around each chunk, for the schedule
    for hf_name, full in shards.export(lambda p: p.detach()): ...   # TP (and EP) shards gathered

Parameters are named globally here (layer and expert indices of the whole model), which is what
megarl/models/convert.py maps to HF names.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megarl.models import mcore
from megarl.models.build import build_gpt, transformer_config
from megarl.models.convert import assemble, expert_of, hf_slices, megatron_names, megatron_to_hf, to_global, to_local
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.models.spec import ModelSpec
from megarl.parallel import cpu_compat, state
from megarl.workers.logprob import hidden_to_head
from megarl.workers.preflight import EngineSpec


class Shards(cpu_compat.Boundary):
    def __init__(self, es: EngineSpec, spec: ModelSpec, dtype: torch.dtype):
        mcore.require()
        self.es, self.spec, self.dtype = es, spec, dtype
        # parameter names a model converter added (set by the engine once they convert the chunks)
        self.added: Callable[[str], bool] = lambda name: False
        self.layout = state.init_model_parallel(es.tp, es.pp, es.seed, cp=es.cp, vpp=es.vpp, ep=es.ep)
        self.device = state.device()
        self.config = transformer_config(spec, es.tp, es.pp, dtype, sequence_parallel=es.sequence_parallel,
                                         recompute=es.recompute, overrides=es.transformer_overrides,
                                         cp=es.cp, vpp=es.vpp, ep=es.ep, etp=es.etp, routing_replay=es.routing_replay)
        # MoE: this expert-parallel rank holds global experts [expert_offset, + num_experts / EP).
        self.expert_offset = self.layout.ep_rank * (spec.num_experts // self.layout.ep)
        self.models, self.offsets = self._build_chunks()
        for m in self.models:  # the LM head is applied by the log-prob code (logprob.linear_log_probs)
            if es.head == "lm" and m.post_process:
                hidden_to_head(m.output_layer, self.config.sequence_parallel)
        self._check_names()

    def _build_chunks(self) -> tuple[list, list[int]]:
        """This rank's model: one GPTModel per virtual-pipeline chunk (one without VPP), each
        with the global index of its first layer. Chunk v of stage p holds the layers of virtual
        stage v*PP + p (megatron's interleaved order)."""
        models, offsets = [], []
        for v in range(self.layout.vpp):
            vp = v if self.layout.vpp > 1 else None
            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            model = build_gpt(self.spec, self.config, first, last, self.es.head, vp_stage=vp)
            models.append(model.to(self.device))
            offsets.append(get_transformer_layer_offset(self.config, vp_stage=vp))
        return models, offsets

    def wrap(self) -> list:
        """The chunks as the schedule runs them: Float16Module below fp32, DDP when trainable
        (a frozen role's parameters stop requiring gradients instead)."""
        out = []
        for model in self.models:
            if self.dtype != torch.float32:
                model = Float16Module(self.config, model)
            if self.es.trainable:
                ddp = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                                                       **self.es.ddp_overrides,
                                                       "use_distributed_optimizer": self.es.use_distributed_optimizer})
                model = DistributedDataParallel(self.config, ddp, model)
            out.append(model)
        if not self.es.trainable:
            for p in self.parameters():
                p.requires_grad_(False)
        elif self.es.ddp_overrides.get("overlap_grad_reduce"):
            # As megatron's training loop wires it: the schedule holds each bucket's reduction back
            # until the last micro-batch (no_sync), and under PP starts a chunk's as its backward ends.
            one = len(out) == 1
            self.config.no_sync_func = out[0].no_sync if one else [m.no_sync for m in out]
            self.config.grad_sync_func = out[0].start_grad_sync if one else [m.start_grad_sync for m in out]
        return out

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

    # -- reading the shards -------------------------------------------------------------------------
    def parameters(self):
        for m in self.models:
            yield from m.parameters()

    def named_global_parameters(self):
        """(global megatron name, parameter) over every chunk of this rank: the model's own, not
        what a model converter added (a LoRA adapter: the converter exports those itself)."""
        for m, off in zip(self.models, self.offsets):
            for local, p in m.named_parameters():
                if not self.added(local):
                    yield to_global(local, off, self.expert_offset), p

    def head_weight(self) -> torch.Tensor:
        """This TP rank's vocabulary rows of the LM head (the embedding when tied), last stage."""
        m = self.models[-1]  # the last (virtual) stage holds the head
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    @property
    def experts(self) -> range:
        """The global experts this rank holds (MoE; empty for a dense model)."""
        return range(self.expert_offset, self.expert_offset + self.spec.num_experts // self.layout.ep)

    @property
    def layers(self) -> list[int]:
        """Global indices of the layers on this rank (every chunk)."""
        return [off + i for m, off in zip(self.models, self.offsets) for i in range(len(m.decoder.layers))]

    # -- HF in and out ------------------------------------------------------------------------------
    def load_hf(self, ckpt: HFCheckpoint) -> None:
        """Copy this rank's slices of the HF checkpoint into its shard (reads only those bytes)."""
        head, lay = self.es.head, self.layout
        with torch.no_grad():
            for name, param in self.named_global_parameters():
                if head == "value" and name == "output_layer.weight" and not self.es.head_from_checkpoint:
                    param.zero_()  # a fresh value head predicts 0 until the critic learns
                    continue
                pieces = {s.hf_name: ckpt.read(s) for s in hf_slices(name, self.spec, lay.tp_rank, lay.tp, head)}
                shard = assemble(name, pieces, self.spec, lay.tp_rank, lay.tp, head)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: built a shard of shape {list(shard.shape)} for a parameter of "
                                     f"shape {list(param.shape)}")
                param.copy_(shard)

    def export(self, value):
        """(HF name, full tensor) of value(param) for this pipeline stage: TP shards all-gathered
        (every TP rank yields the same), experts gathered over EP. The weights must be on the
        device (the engine onloads first)."""
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
