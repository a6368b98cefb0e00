"""MegatronEngine: one role's model shards on this rank, run through megatron's pipeline schedule.

The actor, critic and reference are thin layers over it (megarl/workers/{actor,critic,reference}.py):

    state.init_distributed(timeout_s)     # the rank set-up's (megarl/job/ranks.py), never the engine's
    eng = MegatronEngine(EngineSpec(path, tp=2, pp=2, head="lm", trainable=True, optim=cfg))
    rows = eng.forward_rows(batch, micro=4, process=fn)           # forward-only, full batch back
    metrics = eng.train(batch, mini=16, micro=4, epochs=1, process=fn, loss_fn=loss, prefix="actor")

It is a facade over four parts, each one responsibility, built once here and handed only what
they need:

    shards.py    Shards    the model chunks: build, HF load/export, global names
    schedule.py  Schedule  a batch cut into micro-batches and run through megatron's schedule
    update.py    Update    epochs/shuffle, optimizer step, grad clip, LR schedule, metric means
    memory.py    Memory    the device tensors a role holds; offload/onload
    checkpoint.py          megatron distributed checkpoints (save_checkpoint/load_checkpoint here)

The facade keeps the counters that outlive one call (tokens computed vs real for take_padding,
MoE micro-batches for the router metrics): a part returns its counts (schedule.Run) and this
file adds them, so no part changes state behind the caller's back. Every class here and in the
parts is a cpu_compat.Boundary: their methods run with megatron's CUDA literals mapped to CPU
when there is no GPU, without a decorator per method.

Gradient contract of `train` (megarl/workers/update.py): the applied gradient is the plain sum
of d(loss_i) over every micro-batch on every DP rank. Loss functions normalise themselves with
meta_info["global_tokens"] / ["global_seqs"], so token-mean is exact whatever the micro-batching
and DP size. How a batch is cut (megarl/workers/batching.py: plan) and laid out
(megarl/workers/packing.py): `micro` rows per micro-batch, or with `max_tokens` as many as fit
that token budget; rows packed back to back (THD, EngineSpec.packing) or right-padded. The LM
head is applied by the log-prob code chunk by chunk (megarl/workers/logprob.py), so the model
hands back hidden states and full logits never exist.
"""
from __future__ import annotations

import torch

from megarl.models.converters import build_model_converters
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.parallel import cpu_compat, state
from megarl.protocol import DataProto
from megarl.workers import batching, checkpoint
from megarl.workers.memory import Memory
from megarl.workers.moe import moe_metrics
from megarl.workers.outputs import full_logits
from megarl.workers.preflight import EngineSpec, read_spec, resolve_dtype
from megarl.workers.schedule import LossFn, Padding, Process, Run, Schedule
from megarl.workers.shards import Shards
from megarl.workers.update import Update

__all__ = ["EngineShardView", "EngineSpec", "LossFn", "MegatronEngine", "Process"]


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


class MegatronEngine(cpu_compat.Boundary):
    def __init__(self, es: EngineSpec):
        self.es = es
        self.dtype = resolve_dtype(es.dtype, es.trainable)
        self.spec, ckpt, self.hf_dtype = read_spec(es)  # hf_dtype: what exports write back
        state.require_distributed("MegatronEngine")
        self.shards = Shards(es, self.spec, self.dtype)
        # what the roles, the checkpoint engine and checkpoint.py read
        self.layout, self.device, self.config = self.shards.layout, self.shards.device, self.shards.config
        self.models, self.offsets, self.expert_offset = self.shards.models, self.shards.offsets, \
            self.shards.expert_offset
        if ckpt is not None:
            self.shards.load_hf(ckpt)
        # after the HF load (a converter sees real weights) and before the wrap, so DDP's buffers
        # and the optimizer see the converted parameters
        self.converters = build_model_converters(es.converters)
        self.converters.convert(self.models)
        self.shards.added = self.converters.added      # what a converter added is not the model's own
        self.chunks = self.shards.wrap()
        self.update = Update(self.shards, self.chunks, es) if es.trainable else None
        self.optimizer = self.update.optimizer if self.update else None
        self.schedule = Schedule(self.shards, self.chunks, packed=es.packing and es.cp == 1)
        self.memory = Memory(self.shards, self.chunks, self.optimizer, es.trainable)
        self._padding = Padding()   # since the last take_padding()
        self._moe_calls = 0         # micro-batches since the last train() (MoE router-loss averages)
        if es.dist_checkpoint:
            self.load_checkpoint(es.dist_checkpoint, with_optimizer=False)

    # -- the shards -----------------------------------------------------------------------------------
    @property
    def model(self):
        """The model of this rank when it holds one chunk (no virtual pipeline)."""
        if len(self.models) != 1:
            raise RuntimeError("this engine holds several virtual-pipeline chunks; use engine.models")
        return self.models[0]

    @property
    def layer_offset(self) -> int:
        return self.offsets[0]

    @property
    def experts(self) -> range:
        return self.shards.experts

    @property
    def layers(self) -> list[int]:
        return self.shards.layers

    @property
    def sched_step(self) -> int:
        return self.update.sched_step if self.update else 0

    @property
    def packed(self) -> bool:
        return self.schedule.packed

    def parameters(self):
        return self.shards.parameters()

    def named_global_parameters(self):
        return self.shards.named_global_parameters()

    def head_weight(self) -> torch.Tensor:
        return self.shards.head_weight()

    def load_hf(self, ckpt: HFCheckpoint) -> None:
        self.shards.load_hf(ckpt)

    def hf_tensors(self):
        """(HF name, full tensor) for this pipeline stage, TP shards all-gathered (every TP rank
        yields the same; at TP=1 some are views of the live weights). A simple exporter; the
        checkpoint engine plans its own transfers. A converter's exported values where it has them
        (LoRA: the merged weights)."""
        self.onload()
        return self.shards.export(self.converters.export_value(self.models))

    def hf_grads(self):
        """(HF name, full accumulated gradient) for this stage, like hf_tensors (checks and debugging)."""
        self.onload()
        return self.shards.export(lambda p: p.main_grad.clone())

    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        checkpoint.save_checkpoint(path, self, with_optimizer)

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        checkpoint.load_checkpoint(path, self, with_optimizer)

    # -- running batches ------------------------------------------------------------------------------
    def forward_rows(self, data: DataProto, micro: int, process: Process, keys: tuple[str, ...],
                     tails: dict[str, tuple] | None = None, max_tokens: int | None = None,
                     routes: str | None = None) -> dict:
        """Forward the full batch (every rank passes the same one); returns {key: [B, *tail]} on
        every rank (tail defaults to (R,)). Micro-batches of `micro` rows, or with `max_tokens` of
        as many as fit that budget. MoE routing replay: routes="replay" follows the batch's
        routed_experts, "record" returns them as rows["routed_experts"] (megarl/workers/routes.py)."""
        batching.check_batch(data)
        self.onload()
        return self._count(self.schedule.forward_rows(data, micro, process, keys, tails, max_tokens, routes)).rows

    def logits(self, input_ids: torch.Tensor, micro: int = 1) -> torch.Tensor:
        """Full-vocabulary logits [B, S, V] (fp32) of unpadded token rows, on every rank (checks)."""
        B, S = input_ids.shape
        data = DataProto.from_dict({"input_ids": input_ids, "prompt_lens": torch.full((B,), S),
                                    "response_lens": torch.zeros(B, dtype=torch.long),
                                    "responses": torch.zeros(B, 1, dtype=torch.long)})
        group, vocab = state.tp_group(), self.spec.vocab_size
        rows = self.forward_rows(data, micro, lambda out, mb: {"logits": full_logits(out, self.head_weight(), vocab,
                                                                                     group, mb)},
                                 ("logits",), {"logits": (S, vocab)})
        return rows["logits"]

    def accumulate(self, mini_batch: DataProto, micro: int, process: Process, loss_fn: LossFn,
                   seq: int | None = None, max_tokens: int | None = None, routes: str | None = None) -> list[dict]:
        """Fresh gradients of one mini-batch (the whole one; every rank passes the same): this DP
        rank's share in micro-batches (`micro` rows, or by the `max_tokens` budget) through the
        schedule, DP-summed. Returns the last stage's per-micro-batch metrics."""
        self.onload()
        run = self._count(self.schedule.accumulate(mini_batch, micro, process, loss_fn, seq, max_tokens, routes))
        self._moe_calls += run.micro_batches
        return run.outputs

    def train(self, data: DataProto, mini: int, micro: int, epochs: int, process: Process, loss_fn: LossFn,
              prefix: str, shuffle: bool = False, max_tokens: int | None = None,
              routes: str | None = None) -> dict[str, float]:
        """`epochs` passes over mini-batches of `mini` sequences, one optimizer step each; one
        LR-schedule step per call (megarl/workers/update.py)."""
        if self.update is None:
            raise RuntimeError("this model is frozen")
        batching.check_batch(data, need_mask=True)
        self.onload()
        seq = batching.seq_len(data)
        return self.update.train(data, mini, micro, epochs, prefix, shuffle, max_tokens,
                                 accumulate=lambda mb: self.accumulate(mb, micro, process, loss_fn, seq, max_tokens,
                                                                       routes),
                                 extra=lambda: self._moe_metrics(prefix))

    def take_padding(self) -> tuple[int, int]:
        """(tokens computed, real tokens) over every pass since the last call; resets them."""
        out, self._padding = self._padding, Padding()
        return out.computed, out.real

    def _count(self, run: Run) -> Run:
        self._padding += run.padding
        return run

    def _moe_metrics(self, prefix: str) -> dict[str, float]:
        calls, self._moe_calls = self._moe_calls, 0
        return moe_metrics(self.spec, self.layout, self.device, calls, prefix)

    # -- memory ---------------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Device bytes this role holds now in weights, grad buffers and optimizer state."""
        return self.memory.resident_bytes()

    def offload(self, params: bool = True, grads: bool = False, optimizer: bool = False) -> int:
        """Move the chosen state to host memory until `onload` (the next forward, update or save
        calls it); returns the bytes moved (megarl/workers/memory.py)."""
        return self.memory.offload(params, grads, optimizer)

    def onload(self) -> None:
        self.memory.onload()
