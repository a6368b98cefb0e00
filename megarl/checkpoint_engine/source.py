"""Where a sync reads megatron shards from: this rank's stage of the actor, and its groups.

    src = ShardSource.from_actor(actor)     # every training rank
    src.params["decoder.layers.3.mlp.linear_fc1.weight"]   # this rank's TP shard (global name)

Names are global (layer index counted over the whole model), as megarl/models/convert.py uses
them; the tensors are the live parameters (no copy).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.models.convert import expert_of, to_global, to_local
from megarl.models.converters import ExportedParams
from megarl.models.spec import ModelSpec
from megarl.parallel import state


@dataclass
class ShardSource:
    spec: ModelSpec
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    params: dict[str, torch.Tensor]        # global megatron name -> this rank's shard (its stage only)
    head: str = "lm"
    tp_group: Any = None                   # megatron's TP group (None when TP = 1)
    pp_group: Any = None                   # megatron's PP group (None when PP = 1)
    hf_dtype: torch.dtype | None = None    # the HF checkpoint's dtype (what disk exports write)
    vpp: int = 1                           # virtual-pipeline chunks per stage (params hold them all)
    ep: int = 1                            # MoE expert parallel: `params` holds this rank's experts only
    ep_rank: int = 0
    ep_group: Any = None

    @classmethod
    def from_actor(cls, actor) -> "ShardSource":
        """The actor's live shards (`model_chunks`, one `layer_offsets` entry each) and megatron's groups."""
        eng = actor.engine
        lay = eng.layout
        params, computed = {}, {}
        offsets = getattr(actor, "layer_offsets", None) or [actor.layer_offset]
        for chunk, offset in zip(actor.model_chunks, offsets, strict=True):
            expert_offset = getattr(eng, "expert_offset", 0)
            for local, p in chunk.named_parameters():
                if not eng.converters.added(local):
                    params[to_global(local, offset, expert_offset)] = p.data
            # a converter's exported values (LoRA: W + scale B A from the live adapters), at each read
            exported = eng.converters.exported(chunk)
            computed.update({to_global(n, offset, expert_offset): fn for n, fn in exported.items()})
        if computed:
            params = ExportedParams(params, computed)
        return cls(spec=actor.spec, tp=lay.tp, pp=lay.pp, tp_rank=lay.tp_rank, pp_rank=lay.pp_rank,
                   dp_rank=lay.dp_rank, params=params, head=eng.es.head,
                   tp_group=state.tp_group() if lay.tp > 1 else None,
                   pp_group=state.pp_group() if lay.pp > 1 else None, hf_dtype=getattr(eng, "hf_dtype", None),
                   vpp=getattr(lay, "vpp", 1), ep=lay.ep, ep_rank=lay.ep_rank,
                   ep_group=state.ep_group() if lay.ep > 1 else None)

    @contextlib.contextmanager
    def all_experts(self):
        """Collective over the EP group (every rank calls it): for the duration, `params` holds
        every expert's TP shard, the other EP ranks' ones all-gathered, so a transfer plan sees
        an EP = 1 layout. Costs one extra copy of the other ranks' experts while a sync runs (what
        the colocated engine holds anyway); one all-gather per expert tensor."""
        if self.ep == 1:
            yield
            return
        per = self.spec.num_experts // self.ep
        mine = self.ep_rank * per
        # Every EP rank holds the same local names; sorting them gives one order everywhere.
        local = sorted(to_local(n, 0, mine) for n in self.params if expert_of(n) is not None)
        extra: dict[str, torch.Tensor] = {}
        for name in local:
            t = self.params[to_global(name, 0, mine)].contiguous()
            parts = [torch.empty_like(t) for _ in range(self.ep)]
            dist.all_gather(parts, t, group=self.ep_group)
            extra.update({to_global(name, 0, r * per): part for r, part in enumerate(parts) if r != self.ep_rank})
        self.params.update(extra)
        try:
            yield
        finally:
            for name in extra:
                del self.params[name]

    @property
    def dtype(self) -> torch.dtype:
        dtypes = {p.dtype for p in self.params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the actor's parameters mix dtypes {sorted(map(str, dtypes))}; a weight sync "
                             "moves one dtype (wrap the model in one precision)")
        return dtypes.pop()

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline (its PP group)."""
        if self.pp_group is None:
            return dist.get_rank()
        return dist.get_global_rank(self.pp_group, stage)
