"""Shared pieces of the weight-sync tests: building actors and engines inside spawned ranks,
deterministic weight changes, and exact checks of what an engine holds."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from megarl.experiment import load_config
from megarl.protocol import DataProto
from megarl.rollout.base import SamplingParams

PROMPTS = [[5, 17, 42, 8], [3, 3, 9], [100, 7, 250, 31, 12, 4]]
TEMP = 0.7


def actor_at(path: str, tp: int, pp: int, micro: int = 2):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=micro,
                      megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                      optim=OptimConfig(lr=1e-3))
    state.init_distributed()   # the rank set-up; the engine starts no process group
    return ActorWorker(ModelConfig(path=path), cfg)


def rollout_groups(rtp: int):
    """Contiguous blocks of `rtp` ranks (every rank creates every group); this rank's, or None."""
    mine = None
    for first in range(0, dist.get_world_size(), rtp):
        members = list(range(first, first + rtp))
        group = dist.new_group(members) if rtp > 1 else None
        if dist.get_rank() in members:
            mine = group
    return mine


def native_engine(path: str, group, **kwargs):
    """A native engine without weights (load_format=dummy): they come from the first sync."""
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.native import NativeEngine, TPComm
    return NativeEngine(read_hf_config(path), comm=TPComm(group), **kwargs)


def perturb(actor, scale: float = 0.02) -> None:
    """Change every element of every shard, deterministically: replicated tensors identically on
    every TP rank, split ones per TP rank, DP replicas alike."""
    from megarl.models.convert import tp_dim, to_global
    lay = actor.engine.layout
    with torch.no_grad():
        for local, p in actor.model_chunks[0].named_parameters():
            name = to_global(local, actor.layer_offset)
            split = tp_dim(name) is not None
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * lay.tp_rank if split else 0))
            p.add_(scale * (1.0 + torch.rand(p.shape, generator=g)).to(p.dtype))  # >= scale everywhere


def full_export(actor) -> dict[str, torch.Tensor]:
    """Every HF tensor of the actor on every rank (each stage's export, shared over the world)."""
    mine = {n: t.clone() for n, t in actor.hf_tensors()}      # collective over TP: every rank calls it
    lay = actor.engine.layout
    mine = mine if lay.tp_rank == 0 and lay.dp_rank == 0 else {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for p in parts:
        out.update(p)
    return out


def engine_mismatch(engine, expected: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """(max |engine - expected| over every element the expected tensors map to, the engine
    parameters some rows of which no expected tensor covers). Exact and complete: (0.0, [])."""
    worst, covered = 0.0, {}
    for name, full in expected.items():
        for dst, rows, src in engine.plan.route(name, full):
            got = engine.params[dst].data[rows]
            if got.numel():
                worst = max(worst, (got.float() - src.float()).abs().max().item())
            mask = covered.setdefault(dst, torch.zeros(engine.params[dst].shape[0], dtype=torch.bool))
            mask[rows] = True
    # embed / lm_head rows past the real vocabulary are padding that nothing maps to
    untouched = [n for n, p in engine.params.items()
                 if n not in covered or (n not in ("embed", "lm_head") and not covered[n].all())]
    return worst, untouched


def rollout_vs_actor(engine, actor, seed: int = 0) -> tuple[float, list]:
    """Sample from the engine, score the same tokens with the actor; (max |difference| of the
    log-probs, the sampled token ids). Every rank samples the same tokens (same seed and weights)."""
    batch = DataProto(non_tensor_batch={"prompt_token_ids": [list(p) for p in PROMPTS]},
                      meta_info={"sampling": SamplingParams(n=2, max_tokens=6, temperature=TEMP, seed=seed)})
    out = engine.generate_sequences(batch)
    lp, _ = actor.compute_log_prob(out, temperature=TEMP, with_entropy=False)
    mask = out.batch["response_mask"].bool()
    diff = (lp - out.batch["rollout_log_probs"]).abs()[mask].max().item()
    return diff, out.batch["responses"].tolist()


class Faulty:
    """Makes this rank's engine fail on its `at`-th bucket (after loading part of it), as a
    failed host->device copy or an OOM would, then behave again."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.calls = engine, at, 0
        self.real = {m: getattr(engine, m) for m in ("update_weights", "update_weight_shards")}
        for method, fn in self.real.items():
            setattr(engine, method, self._wrap(fn))

    def _wrap(self, fn):
        def call(bucket):
            self.calls += 1
            if self.calls == self.at:
                items = iter(bucket)
                fn([next(items)])          # a partial load: the engine now holds a mix
                raise RuntimeError("injected failure while loading a bucket")
            return fn(bucket)
        return call

    def restore(self):
        for method in self.real:
            delattr(self.engine, method)


def experiment(path: str, tp: int, pp: int, rtp: int, **ce):
    overrides = [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=4",
                 f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                 f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
                 f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp}",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "data.train_batch_size=4"]
    overrides += [f"actor_rollout_ref.rollout.checkpoint_engine.{k}={v}" for k, v in ce.items()]
    return load_config(None, overrides)


def generated_batch(engine) -> DataProto:
    """The engine's generate_sequences over PROMPTS (n=2, 6 tokens, seed 3)."""
    batch = DataProto(non_tensor_batch={"prompt_token_ids": [list(p) for p in PROMPTS]},
                      meta_info={"sampling": SamplingParams(n=2, max_tokens=6, temperature=TEMP, seed=3)})
    return engine.generate_sequences(batch)


def megatron_shards(full: dict, spec, tp: int, pp: int, t: int, p: int) -> dict:
    """TP rank t of stage p's megatron shards, cut from HF tensors by megarl's own converter."""
    from megarl.checkpoint_engine.plan import stage_names
    from megarl.models.convert import hf_to_megatron
    return {n: hf_to_megatron(n, full, spec, t, tp) for n in stage_names(spec, pp, p)}
