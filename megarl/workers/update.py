"""Update: the optimizer side of a trainable role: epochs over shuffled mini-batches, one
clipped optimizer step each, the LR schedule, and the metrics averaged over every rank. Part of
MegatronEngine (megarl/workers/engine.py).

    upd = Update(shards, chunks, es)            # builds the optimizer, hooks megatron's grad finalize
    metrics = upd.train(data, mini, micro, epochs, "actor", shuffle, max_tokens,
                        accumulate=lambda mb: engine.accumulate(mb, ...), extra=lambda: {...})

Gradient contract: the gradient applied after a mini-batch is the plain sum, over every
micro-batch on every DP rank, of d(loss_i). Megatron would otherwise divide each loss by the
micro-batch count and average over DP; `calculate_per_token_loss=True` (build.py) makes DDP
sum, and `finalize_grads` below drops the schedule's token-count division.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megarl.parallel import cpu_compat, state
from megarl.protocol import DataProto
from megarl.workers.optim import apply_schedule, build_optimizer, optimizer_step
from megarl.workers.preflight import EngineSpec

log = logging.getLogger("megarl.workers")


class Update(cpu_compat.Boundary):
    def __init__(self, shards, chunks: list, es: EngineSpec):
        self.layout, self.device, self.es = shards.layout, shards.device, es
        self.chunks = chunks
        self.optimizer = build_optimizer(chunks, es.optim, shards.dtype, es.use_distributed_optimizer)
        self.sched_step = 0          # LR-schedule steps taken (one per train() call)
        apply_schedule(self.optimizer, 0, es.optim)
        shards.config.finalize_model_grads_func = finalize_grads
        if shards.dtype == torch.float16:
            shards.config.grad_scale_func = self.optimizer.scale_loss

    def check_split(self, rows: int, mini: int, micro: int, max_tokens: int | None) -> None:
        lay = self.layout
        if rows % mini:
            raise ValueError(f"{rows} sequences do not split into mini-batches of {mini} "
                             "(ppo_mini_batch_size x rollout.n); make the batch a multiple of it")
        if mini % (lay.dp * (1 if max_tokens else micro)):
            raise ValueError(f"a mini-batch of {mini} sequences does not split into DP {lay.dp} x micro-batches of "
                             f"{micro}; change ppo_micro_batch_size_per_gpu")
        if lay.vpp > 1 and (mini // (lay.dp * micro)) % lay.pp:
            raise ValueError(f"virtual pipeline: {mini // (lay.dp * micro)} micro-batches per mini-batch is not a "
                             f"multiple of PP {lay.pp} (megatron's interleaved schedule); change "
                             "ppo_micro_batch_size_per_gpu")

    def train(self, data: DataProto, mini: int, micro: int, epochs: int, prefix: str, shuffle: bool,
              max_tokens: int | None, accumulate: Callable[[DataProto], list[dict]],
              extra: Callable[[], dict]) -> dict[str, float]:
        """`epochs` passes over mini-batches of `mini` sequences; `accumulate(mini_batch)` leaves
        its gradients and returns the last stage's per-micro-batch metrics, then one optimizer
        step. One LR-schedule step per call. The loss function's metrics are means over its
        micro-batch (verl's convention): they are averaged over every micro-batch of every DP
        rank, mini-batch and epoch; `extra()` adds its own after them."""
        self.check_split(len(data), mini, micro, max_tokens)
        for c in self.chunks:
            c.train()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        skipped, norms = 0, []
        lr = self.optimizer.param_groups[0]["lr"]
        for epoch in range(epochs):
            for mb_data in self._order(data, epoch, shuffle).split(mini):
                got = host_metrics(accumulate(mb_data))
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
        metrics = self.mean_metrics(sums, counts)
        metrics.update(extra())
        metrics.update({f"{prefix}/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
                        f"{prefix}/lr": lr, f"{prefix}/skipped_steps": float(skipped)})
        self.resume(self.sched_step + 1)
        return metrics

    def _order(self, data: DataProto, epoch: int, shuffle: bool) -> DataProto:
        """The batch as the epoch sees it: as given, or shuffled by a generator seeded from the
        role's seed, the schedule step and the epoch (a resumed run draws the same order)."""
        if not shuffle:
            return data
        g = torch.Generator().manual_seed(self.es.seed + 1000 * self.sched_step + epoch)
        return data[torch.randperm(len(data), generator=g)]

    def step(self, got: list[dict]) -> tuple[bool, float]:
        """Clip and apply the accumulated gradients, unless a loss (any rank's) or the norm is not finite."""
        bad = torch.tensor(float(any(not math.isfinite(g["_loss"]) for g in got)), device=self.device)
        if dist.get_world_size() > self.layout.tp:   # TP ranks share one loss; other ranks may differ
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return optimizer_step(self.optimizer, self.es.optim.clip_grad, bool(bad))

    def resume(self, sched_step: int) -> None:
        """Put the LR schedule at `sched_step` (each train() call takes one; a checkpoint restores it)."""
        self.sched_step = sched_step
        apply_schedule(self.optimizer, sched_step, self.es.optim)

    def mean_metrics(self, sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
        """Mean of each metric over the micro-batches of all DP ranks (the last stages hold them);
        every rank gets the result."""
        payload = [(sums, counts) if self.layout.is_last_stage else None]
        if self.layout.pp > 1:
            dist.broadcast_object_list(payload, src=state.pp_last_rank(), group=state.pp_group())
        gathered = [payload[0]]
        if self.layout.dp > 1:
            gathered = [None] * self.layout.dp
            dist.all_gather_object(gathered, payload[0], group=state.dp_group())
        keys = sorted({k for s, _ in gathered for k in s})
        return {k: sum(s.get(k, 0.0) for s, _ in gathered) / max(sum(c.get(k, 0) for _, c in gathered), 1)
                for k in keys}


def host_metrics(per_micro_batch: list[dict]) -> list[dict[str, float]]:
    """Each micro-batch's metrics (0-dim tensors or numbers) as floats, with one device-to-host
    copy for all of them: a float() each was a device sync each on GPU, ~9 per micro-batch."""
    tensors = [v for m in per_micro_batch for v in m.values() if torch.is_tensor(v)]
    if tensors:    # (a loss function may make a constant on the host: one device for all)
        tensors = [t.reshape(()).to(tensors[0].device, torch.float64) for t in tensors]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [{k: next(values) if torch.is_tensor(v) else float(v) for k, v in m.items()} for m in per_micro_batch]


def finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads without the division by the schedule's token count."""
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
