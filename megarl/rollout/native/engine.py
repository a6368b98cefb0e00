"""The built-in rollout engine: continuous batching over a slot KV cache, TP over torch.distributed.

    engine = NativeEngine.from_pretrained(model_dir, comm=TPComm(group), device="cpu")
    groups = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_tokens=32, seed=0))

Scheduling: prompts wait in a queue; whenever n slots are free, the next prompt is prefilled
once and its K/V forked into n slots; every iteration decodes one token for all active slots;
a finished sequence's slot goes to the next waiting prompt. Every rank of the TP group runs the
same loop on the same inputs and samples the same tokens (counter-based randomness over the
gathered logits), so no token broadcast is needed.

Weights arrive as the HF-named full tensors of the trainer's sync (or of an HF directory, through
the same path), or pre-sharded (`update_weight_shards`, each rank's part only); each rank copies its
slice in place (megarl/rollout/weight_state.py says what that
implies for a failed sync).
"""
from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megarl.rollout.base import BaseRollout, Completion, SamplingParams, ShardSlice, admit
from megarl.rollout.hf_weights import buckets, iter_hf_weights, read_hf_config
from megarl.rollout.native import sampler
from megarl.rollout.native.kv_cache import KVCache
from megarl.rollout.native.model import ModelArgs, Transformer
from megarl.rollout.native.tp import ShardPlan, TPComm
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: fp32 on CPU (log-probs exact to the trainer's), bf16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"rollout.dtype={name!r}: use auto, float32, bfloat16 or float16")
    return table[name]


@dataclass
class _Row:
    """One active sequence (one slot)."""
    prompt: int
    sample: int
    key: int
    length: int                            # tokens in the KV cache
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


class NativeEngine(BaseRollout):
    def __init__(self, hf_config: dict, *, comm: TPComm | None = None, device: str | torch.device = "cpu",
                 dtype: str = "auto", max_num_seqs: int = 256, prompt_length: int | None = None,
                 prompt_truncation: str = "error", sleep_level: int = 1, gpu_memory_utilization: float = 0.5,
                 kv_cache_gb: float | None = None, config=None):
        super().__init__(config, role="rollout")
        self.comm = comm or TPComm(None)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.args = ModelArgs.from_hf(hf_config)
        self.model = Transformer(self.args, self.comm.size, self.dtype, self.device)
        self.plan = ShardPlan(self.args, self.comm.rank, self.comm.size)
        self.params = dict(self.model.named_parameters())
        self._shapes = {n: p.shape for n, p in self.params.items()}
        self.weights = WeightState(self.plan.expected_names(), ready=False)
        s = self.model.s
        self.cache = KVCache(self.args.n_layers, s.kv_heads, self.args.head_dim, self.dtype, self.device)
        self.guard = PromptGuard(prompt_length, prompt_truncation, vocab_size=self.args.vocab_size)
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level} must be 1 (free KV cache, keep weights) "
                             "or 2 (also drop weights; they return with the next sync)")
        self.max_num_seqs, self.sleep_level = max_num_seqs, sleep_level
        self.gpu_memory_utilization, self.kv_cache_gb = gpu_memory_utilization, kv_cache_gb
        self.asleep = False
        self._offloaded: dict[str, torch.Tensor] = {}
        self._cache_shape = (0, 0)
        self.stats = {"generated_tokens": 0, "prefills": 0, "decode_steps": 0}

    @classmethod
    def from_pretrained(cls, model_dir: str, **kwargs) -> "NativeEngine":
        """Build from an HF directory; the weights go through update_weights like a training sync."""
        engine = cls(read_hf_config(model_dir), **kwargs)
        engine.load_hf_dir(model_dir)
        return engine

    def load_hf_dir(self, model_dir: str, bucket_bytes: int = 256 << 20) -> None:
        for bucket in buckets(iter_hf_weights(model_dir), bucket_bytes):
            self.update_weights(bucket)
        self.finalize_weights()

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._load(bucket, self.plan.route)

    def weight_shard(self, name: str) -> ShardSlice:
        got = self.plan.target(name)
        return got[2] if got is not None else ShardSlice()

    def update_weight_shards(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each tensor is this rank's part of the HF tensor (weight_shard(name).take(full))."""
        self._load(bucket, self.plan.route_shard)

    def _load(self, bucket: Iterable[tuple[str, torch.Tensor]], route) -> None:
        self.weights.begin_bucket()
        for name, tensor in bucket:
            for dst, rows, src in route(name, tensor):
                param = self.params[dst]
                if param.numel() == 0:           # released by sleep(): bring back the old values or zeros
                    host = self._offloaded.pop(dst, None)
                    param.data = (host.to(self.device) if host is not None else
                                  torch.zeros(self._shapes[dst], dtype=self.dtype, device=self.device))
                param.data[rows].copy_(src)
            self.weights.received(name)

    def finalize_weights(self) -> None:
        self.weights.finalize()

    def abort_weight_update(self) -> None:
        self.weights.abort()

    # -- memory ----------------------------------------------------------------------------------
    def sleep(self, level: int | None = None) -> None:
        """Free the KV cache; level 1 keeps the weights (offloaded to host memory on GPU), level 2
        drops them (they come back with the next weight sync)."""
        level = level or self.sleep_level
        self._cache_shape = (self.cache.slots, self.cache.max_len) if self.cache.allocated else self._cache_shape
        self.cache.free()
        if level == 2:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            self.weights.release()
        elif self.device.type == "cuda":
            for name, p in self.params.items():
                self._offloaded[name] = p.data.to("cpu", non_blocking=False).pin_memory()
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.asleep = True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        for name, host in self._offloaded.items():
            self.params[name].data = host.to(self.device)
        self._offloaded.clear()
        if self._cache_shape[0]:
            self.cache.ensure(*self._cache_shape)
        self.asleep = False

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling)
        seed = sampling.seed
        if seed is None:                          # one random seed that every TP rank agrees on
            seed = self.comm.agree(int(torch.randint(0, 2**62, ()).item()))
        n, max_len = sampling.n, max(map(len, prompts)) + sampling.max_tokens
        slots = max(n, min(self.max_num_seqs, len(prompts) * n, self._slot_cap(max_len)))
        self.cache.ensure(slots, max_len)
        return _Scheduler(self, prompts, sampling, seed, slots).run()

    def _slot_cap(self, max_len: int) -> int:
        """Slots that fit the KV-cache budget: kv_cache_gb if set, on GPU gpu_memory_utilization of
        the device minus what is already allocated; on CPU unbounded (max_num_seqs decides)."""
        per_slot = self.cache.bytes_per_slot_token() * max_len
        held = self.cache.bytes_per_slot_token() * self.cache.slots * self.cache.max_len
        if self.kv_cache_gb is not None:
            budget = self.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = self.gpu_memory_utilization * total - torch.cuda.memory_allocated(self.device) + held
        else:
            return self.max_num_seqs
        return max(1, int(budget // per_slot))


class _Scheduler:
    """One generate() call: the queue, the active rows (slots 0..B-1) and the decode loop."""

    def __init__(self, engine: NativeEngine, prompts, sampling: SamplingParams, seed: int, slots: int):
        self.e, self.prompts, self.sp, self.seed, self.slots = engine, prompts, sampling, seed, slots
        self.stops = sampling.stop_ids
        self.rows: list[_Row] = []
        self.out: list[list[Completion | None]] = [[None] * sampling.n for _ in prompts]
        V = engine.args.vocab_size
        self.seen = (torch.zeros(slots, V, dtype=torch.bool, device=engine.device)
                     if sampling.repetition_penalty != 1.0 else None)

    def _sample(self, logits, rows: list[_Row], first: int):
        sp = self.sp
        u = torch.tensor([sampler.uniform(r.key, len(r.tokens)) for r in rows], dtype=torch.float64,
                         device=logits.device)
        seen = self.seen[first:first + len(rows)] if self.seen is not None else None
        tok, logp = sampler.sample(logits, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                   greedy=sp.greedy, u=u, seen=seen, repetition_penalty=sp.repetition_penalty)
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        for r, t, lp in zip(rows, tok.tolist(), logp.tolist()):
            r.tokens.append(t)
            r.logps.append(lp)

    def _admit(self, i: int) -> None:
        e, n, first = self.e, self.sp.n, len(self.rows)
        ids = torch.tensor(self.prompts[i], dtype=torch.long, device=e.device)
        logits = e.model.prefill(ids, e.cache, first, e.comm)                        # [V]
        e.cache.fork(first, list(range(first + 1, first + n)), len(ids))
        e.stats["prefills"] += 1
        new = [_Row(i, j, sampler.sample_key(self.seed, i, j), len(ids)) for j in range(n)]
        self.rows.extend(new)
        if self.seen is not None:
            self.seen[first:first + n] = False
            self.seen[first:first + n, ids] = True
        self._sample(logits.expand(n, -1), new, first)

    def _retire(self) -> None:
        """Record finished rows; move the last active row into each freed slot."""
        max_tokens = self.sp.max_tokens
        for slot in range(len(self.rows) - 1, -1, -1):
            r = self.rows[slot]
            if r.tokens[-1] in self.stops:
                reason = "stop"
            elif len(r.tokens) >= max_tokens:
                reason = "length"
            else:
                continue
            self.out[r.prompt][r.sample] = Completion(r.tokens, r.logps, reason)
            self.e.stats["generated_tokens"] += len(r.tokens)
            last = len(self.rows) - 1
            if slot != last:
                moved = self.rows[last]
                self.e.cache.move(last, slot, moved.length)
                if self.seen is not None:
                    self.seen[slot] = self.seen[last]
                self.rows[slot] = moved
            self.rows.pop()

    def run(self) -> list[list[Completion]]:
        e, n = self.e, self.sp.n
        queue = deque(range(len(self.prompts)))
        while queue or self.rows:
            while queue and self.slots - len(self.rows) >= n:
                self._admit(queue.popleft())
            self._retire()
            if not self.rows:
                continue
            ids = torch.tensor([r.tokens[-1] for r in self.rows], dtype=torch.long, device=e.device)
            pos = torch.tensor([r.length for r in self.rows], dtype=torch.long, device=e.device)
            logits = e.model.decode(ids, pos, e.cache, e.comm)                       # [B, V]
            e.stats["decode_steps"] += 1
            for r in self.rows:
                r.length += 1
            self._sample(logits, self.rows, 0)
            self._retire()
        return self.out  # type: ignore[return-value]
