"""The built-in rollout engine: continuous batching over a slot KV cache, TP over torch.distributed.

    engine = NativeEngine.from_pretrained(model_dir, comm=TPComm(group), device="cpu")
    groups = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_tokens=32, seed=0))

Scheduling: prompts wait in a queue; whenever slots are free, the waiting prompts that fit are
prefilled together in one pass (right-padded, at most max_num_batched_tokens padded tokens),
each prompt's K/V written straight into its n sample slots; every iteration decodes one token
for all active slots (on CUDA by replaying a CUDA graph captured for the bucketed batch size,
megarl/rollout/native/rows.py) and samples on the device; a finished sequence's slot goes to
the next waiting prompt. Every rank of the TP group runs the same loop on the same inputs and
samples the same tokens (counter-based randomness over the gathered logits), so no token
broadcast is needed.

Slots: max_num_seqs at most, fewer where the KV cache would not fit the memory budget
(kv_cache_gb, or on GPU gpu_memory_utilization of the device minus what is already allocated).

Weights arrive as the HF-named full tensors of the trainer's sync (or of an HF directory, through
the same path), or pre-sharded (`update_weight_shards`, each rank's part only); each rank copies its
slice in place (megarl/rollout/weight_state.py says what that
implies for a failed sync).
"""
from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

from megarl.rollout.base import BaseRollout, Completion, SamplingParams, ShardSlice, admit
from megarl.rollout.hf_weights import buckets, iter_hf_weights, read_hf_config
from megarl.rollout.native import sampler
from megarl.rollout.native.kv_cache import KVCache
from megarl.rollout.native.model import ModelArgs, Transformer
from megarl.rollout.native.rows import SPAN_UNIT, DecodeStep, Rows, batch_bucket
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


class NativeEngine(BaseRollout):
    def __init__(self, hf_config: dict, *, comm: TPComm | None = None, device: str | torch.device = "cpu",
                 dtype: str = "auto", max_num_seqs: int = 1024, prompt_length: int | None = None,
                 prompt_truncation: str = "error", sleep_level: int = 1, gpu_memory_utilization: float = 0.5,
                 kv_cache_gb: float | None = None, max_num_batched_tokens: int = 8192, enforce_eager: bool = False,
                 config=None):
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
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.max_num_seqs, self.sleep_level = max_num_seqs, sleep_level
        # Padded prompt tokens per prefill pass (a prompt longer than this still goes alone).
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows: Rows | None = None
        # enforce_eager (verl's key): no CUDA graphs. Off CUDA the step always runs eagerly.
        self.decode = DecodeStep(self, graphs=not enforce_eager)
        self.gpu_memory_utilization, self.kv_cache_gb = gpu_memory_utilization, kv_cache_gb
        self.asleep = False
        self._offloaded: dict[str, torch.Tensor] = {}
        self._cache_shape = (0, 0)
        self.stats = {"generated_tokens": 0, "prefills": 0, "prefill_batches": 0, "decode_steps": 0}

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
        self.rows = None
        self.decode.drop()
        if level == 2:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            self.weights.release()
        elif self.device.type == "cuda":
            for name, p in self.params.items():
                self._offloaded[name] = p.data.to("cpu", non_blocking=False).pin_memory()
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.asleep = True
        if self.device.type == "cuda":
            # Only here: empty_cache can return only what nothing references, and a reference
            # cycle may still hold device memory. On CPU the cache and weights go back to the
            # allocator by reference counting alone, and a full collection (0.1-0.8 s in a
            # trainer process full of Python objects) would be pure fixed cost per step.
            gc.collect()
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
        if not prompts:
            return []
        seed = sampling.seed
        if seed is None:                          # one random seed that every TP rank agrees on
            seed = self.comm.agree(int(torch.randint(0, 2**62, ()).item()))
        n, T = sampling.n, sampling.max_tokens
        max_len = max(map(len, prompts)) + T
        self.model._check_window(max_len)         # Mistral: refuse what a sliding window would change
        if self.decode.static:                    # rounded: fewer reallocations, so fewer recaptures
            max_len = -(-max_len // 64) * 64
        penalty = sampling.repetition_penalty != 1.0
        slots = max(n, min(self.max_num_seqs, len(prompts) * n, self._slot_cap(max_len, T, penalty)))
        self.cache.ensure(slots, max_len)
        if self.rows is None or not self.rows.fits(self.cache.slots, T, penalty):
            old = self.rows
            self.rows = None                      # free before allocating the bigger one
            self.rows = Rows(self.cache.slots, max(T, old.max_tokens if old else 0), self.args.vocab_size,
                             self.device, penalty or (old is not None and old.seen is not None))
        self.model.rope(self.cache.max_len)      # the table a captured graph reads: allocated now
        return _Scheduler(self, prompts, sampling, seed, self.cache.slots).run()

    def _slot_cap(self, max_len: int, max_tokens: int, penalty: bool) -> int:
        """Slots that fit the memory budget (KV cache plus the per-row state): kv_cache_gb if set,
        on GPU gpu_memory_utilization of the device minus what is already allocated; on CPU
        unbounded (max_num_seqs decides)."""
        row_bytes = 4 * 8 + max_tokens * 12 + (self.args.vocab_size if penalty else 0)
        per_slot = self.cache.bytes_per_slot_token() * max_len + row_bytes
        held = self.cache.bytes_per_slot_token() * self.cache.slots * self.cache.max_len
        if self.rows is not None:
            held += sum(t.numel() * t.element_size() for t in self.rows.tensors())
        if self.kv_cache_gb is not None:
            budget = self.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = self.gpu_memory_utilization * total - torch.cuda.memory_allocated(self.device) + held
        else:
            return self.max_num_seqs
        return max(1, int(budget // per_slot))


class _Scheduler:
    """One generate() call: the queue, the active rows (slots 0..B-1) and the decode loop.

    Per iteration: batched prefill of as many waiting prompts as free slots (and the prefill
    token budget) allow; one decode step for all active rows; then one read of which rows hit a
    stop token (the only host sync of a step; lengths are tracked on the host). Finished rows'
    tokens and log-probs come back in one copy, and the last active rows move into their slots.
    """

    def __init__(self, engine: "NativeEngine", prompts, sampling: SamplingParams, seed: int, slots: int):
        self.e, self.prompts, self.sp, self.seed, self.slots = engine, prompts, sampling, seed, slots
        dev = engine.device
        stops = sorted(sampling.stop_ids)
        self.stops = torch.tensor(stops, dtype=torch.long, device=dev) if stops else None
        self.out: list[list[Completion | None]] = [[None] * sampling.n for _ in prompts]
        # Host mirrors of slots 0..B-1: which (prompt, sample) each holds, its position, its step.
        self.prompt = np.zeros(slots, dtype=np.int64)
        self.sample = np.zeros(slots, dtype=np.int64)
        self.pos = np.zeros(slots, dtype=np.int64)
        self.steps = np.zeros(slots, dtype=np.int64)
        self.B = 0

    def _admit(self, idx: list[int]) -> None:
        """Prefill prompts `idx` in one pass; their n samples take slots B..B+len(idx)*n-1."""
        e, n, rows, dev = self.e, self.sp.n, self.e.rows, self.e.device
        k, first = len(idx), self.B
        M, last = k * n, self.B + k * n
        lens = [len(self.prompts[i]) for i in idx]
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(self.prompts[i], dtype=torch.long) for i in idx],
                                              batch_first=True).to(dev)                      # [k, P]
        lengths = torch.tensor(lens, dtype=torch.long, device=dev)
        src = torch.arange(k, device=dev).repeat_interleave(n)                              # [M] prompt of each row
        logits = e.model.prefill(ids, lengths, e.cache, torch.arange(first, last, device=dev), src, e.comm)
        prompt_ix = torch.tensor(idx, dtype=torch.long, device=dev)[src]
        rows.key[first:last] = sampler.sample_keys(self.seed, prompt_ix, torch.arange(n, device=dev).repeat(k))
        rows.step[first:last] = 0
        rows.pos[first:last] = lengths[src]
        if rows.seen is not None:
            V = e.args.vocab_size                 # padding scatters into an extra column, dropped
            pad = torch.arange(ids.shape[1], device=dev)[None, :] >= lengths[:, None]
            seen = torch.zeros(M, V + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, ids.masked_fill(pad, V)[src], True)
            rows.seen[first:last] = seen[:, :V]
        rows.record(first, last, logits[src], self.sp)
        self.prompt[first:last] = np.repeat(idx, n)
        self.sample[first:last] = np.tile(np.arange(n), k)
        self.pos[first:last] = np.repeat(lens, n)
        self.steps[first:last] = 1
        self.B = last
        e.stats["prefills"] += k
        e.stats["prefill_batches"] += 1

    def _retire(self) -> None:
        """Record finished rows; move the last active rows into the freed slots."""
        e, rows, B = self.e, self.e.rows, self.B
        if B == 0:
            return
        stopped = np.zeros(B, dtype=bool)
        if self.stops is not None:           # the one read-back per step
            stopped[torch.isin(rows.tok[:B], self.stops).nonzero().flatten().cpu().numpy()] = True
        done = stopped | (self.steps[:B] >= self.sp.max_tokens)
        fin = np.flatnonzero(done)
        if not len(fin):
            return
        width = int(self.steps[fin].max())
        fin_t = torch.from_numpy(fin).to(e.device)
        toks = rows.out_tok[fin_t, :width].cpu().tolist()
        logps = rows.out_logp[fin_t, :width].cpu().tolist()
        for r, t, lp in zip(fin.tolist(), toks, logps):
            s = int(self.steps[r])
            self.out[self.prompt[r]][self.sample[r]] = Completion(t[:s], lp[:s], "stop" if stopped[r] else "length")
        e.stats["generated_tokens"] += int(self.steps[fin].sum())
        keep = B - len(fin)
        holes = fin[fin < keep]
        movers = np.flatnonzero(~done[keep:]) + keep
        if len(movers):
            e.cache.move(movers.tolist(), holes.tolist(), int(self.pos[movers].max()))
            rows.move(movers.tolist(), holes.tolist())
            for a in (self.prompt, self.sample, self.pos, self.steps):
                a[holes] = a[movers]
        rows.reset(keep, B)
        self.B = keep

    def _step(self) -> None:
        e, B = self.e, self.B
        longest = int(self.pos[:B].max()) + 1
        if e.decode.static:                  # static shapes: bucketed batch and attention span
            Bb = batch_bucket(B, e.cache.slots)
            span = min(-(-longest // SPAN_UNIT) * SPAN_UNIT, e.cache.max_len)
        else:
            Bb, span = B, longest
        e.decode(Bb, span, self.sp)
        self.pos[:B] += 1
        self.steps[:B] += 1
        e.stats["decode_steps"] += 1

    def run(self) -> list[list[Completion]]:
        n, budget = self.sp.n, self.e.max_num_batched_tokens
        queue = deque(range(len(self.prompts)))
        while queue or self.B:
            admitted = False
            while queue and self.slots - self.B >= n:
                idx, longest = [], 0
                while queue and self.slots - self.B - len(idx) * n >= n:
                    longest_next = max(longest, len(self.prompts[queue[0]]))
                    if idx and (len(idx) + 1) * longest_next > budget:
                        break
                    idx.append(queue.popleft())
                    longest = longest_next
                self._admit(idx)
                admitted = True
            if admitted:
                self._retire()
            if not self.B:
                continue
            self._step()
            self._retire()
        return self.out  # type: ignore[return-value]
