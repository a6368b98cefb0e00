"""The built-in rollout engine: continuous batching over a slot KV cache, TP over torch.distributed.

    engine = NativeEngine.from_pretrained(model_dir, comm=TPComm(group), device="cpu")
    groups = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_tokens=32, seed=0))

Scheduling: prompts wait in a queue; whenever rows (n per prompt) and a prompt group are free,
the waiting prompts that fit are prefilled together in one pass (right-padded, at most
max_num_batched_tokens padded tokens), each prompt's K/V written once, into its group, which its
n samples share (megarl/rollout/native/kv_cache.py); every iteration decodes one token for all
active rows (on CUDA by replaying a CUDA graph captured for the bucketed shape,
megarl/rollout/native/rows.py) and samples on the device; a finished sample's row goes to the
next waiting prompt, and its group when the prompt's last sample finishes (one call's loop:
megarl/rollout/native/scheduler.py). Every rank of the TP group runs the same loop on the same
inputs and samples the same tokens (counter-based randomness over the gathered logits), so no
token broadcast is needed.

Rows: max_num_seqs at most, fewer where the KV cache would not fit the memory budget
(kv_cache_gb, or gpu_memory_utilization of the device minus what is already allocated; on CPU
of this rank's share of host memory minus the process's resident set: host_budget.py).
Groups: enough for every row's prompt when n <= 2, else 2 * rows / n (a prompt whose first
samples finished keeps its group until the last one does; the slack lets new prompts in).

Weights arrive as the HF-named full tensors of the trainer's sync (or of an HF directory, through
the same path), or pre-sharded (`update_weight_shards`, each rank's part only); each rank copies its
slice in place (megarl/rollout/weight_state.py says what that
implies for a failed sync).
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch

from megarl.rollout.base import BaseRollout, Completion, SamplingParams, ShardSlice, admit, rollout_dtype
from megarl.models.hf_config import read_hf_config
from megarl.rollout.hf_weights import buckets, iter_hf_weights
from megarl.rollout.native import host_budget
from megarl.rollout.native.kv_cache import KVCache
from megarl.rollout.native.model import ModelArgs, Transformer
from megarl.rollout.native.moe import routes_dtype
from megarl.rollout.native.routes import RouteRecord
from megarl.rollout.native.scheduler import Scheduler
from megarl.rollout.native.rows import DecodeStep, Rows
from megarl.rollout.native.tp import ShardPlan, TPComm
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState


class NativeEngine(BaseRollout):
    def __init__(self, hf_config: dict, *, comm: TPComm | None = None, device: str | torch.device = "cpu",
                 dtype: str = "auto", max_num_seqs: int = 1024, prompt_length: int | None = None,
                 prompt_truncation: str = "error", sleep_level: int = 1, gpu_memory_utilization: float = 0.5,
                 kv_cache_gb: float | None = None, max_num_batched_tokens: int = 8192, enforce_eager: bool = False,
                 record_routes: bool = False, config=None):
        super().__init__(config, role="rollout")
        self.comm = comm or TPComm(None)
        self.device = torch.device(device)
        self.dtype = rollout_dtype(dtype, self.device)
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
        # R3: return each token's routed experts (MoE only; routes.py). Off: nothing is recorded.
        self.record_routes = record_routes and self.args.num_experts > 0
        self.routes_dtype = routes_dtype(self.args.num_experts)
        # Padded prompt tokens per prefill pass (a prompt longer than this still goes alone).
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows: Rows | None = None
        # enforce_eager (verl's key): no CUDA graphs. Off CUDA the step always runs eagerly.
        self.decode = DecodeStep(self, graphs=not enforce_eager)
        self.gpu_memory_utilization, self.kv_cache_gb = gpu_memory_utilization, kv_cache_gb
        self.asleep = False
        self._offloaded: dict[str, torch.Tensor] = {}
        self._cache_shape = (0, 0, 0, 0)
        self.stats = {"generated_tokens": 0, "prefills": 0, "prefill_batches": 0, "decode_steps": 0, "continued": 0,
                      "group_moves": 0, "joined": 0}
        # complete weight loads so far: a call that a load lands inside (between two of its chunk
        # boundaries) tells the tokens sampled after it from those before (Completion.weight_epochs)
        self.weight_loads = 0

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

    def weight_view(self, name: str) -> torch.Tensor | None:
        got = self.plan.target(name)
        if got is None or self.params[got[0]].numel() == 0:    # ignored, or released by sleep(2)
            return None
        return self.params[got[0]].data[got[1]]

    def begin_weight_delta(self) -> None:
        self.weights.begin_delta()

    def finalize_weights(self) -> None:
        self.weights.finalize()
        self.weight_loads += 1

    def abort_weight_update(self) -> None:
        self.weights.abort()

    # -- memory ----------------------------------------------------------------------------------
    def sleep(self, level: int | None = None) -> None:
        """Free the KV cache; level 1 keeps the weights (offloaded to host memory on GPU), level 2
        drops them (they come back with the next weight sync)."""
        level = level or self.sleep_level
        self._cache_shape = self.cache.shape if self.cache.allocated else self._cache_shape
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
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        return self._generate(prompts, sampling, prompt_limit)

    def generate_pausable(self, prompts: list[list[int]], sampling: SamplingParams,
                          pause: Callable[[dict[int, int]], bool], every: int,
                          budgets: list[int] | None = None, samples: list[int] | None = None,
                          prefixes: list[list[list[int]]] | None = None,
                          finished: Callable[[int, int, Completion], None] | None = None,
                          join: Callable[[], tuple[list[list[int]], list[int]] | None] | None = None,
                          ) -> list[list[Completion]]:
        """generate(), asking `pause(unfinished)` at every chunk boundary while anything runs
        (whenever the call's first prompts hold a multiple of `every` tokens: chunks as partial
        rollouts count them; `unfinished` maps each prompt index with samples still running or
        waiting to how many); when it answers True, running samples come back unfinished
        (finish_reason "paused", their tokens so far) and prompts not started with none. Partial
        rollouts use it so that a batch is re-submitted only when a weight update lands, not at
        every chunk (megarl/rollout/partial.py).
        Every rank of a TP group asks at the same iterations: `pause` must answer alike on all.
        `budgets[i]`, when given, caps prompt i's new tokens below sampling.max_tokens (continued
        responses with different budgets left share one call); `samples[i]`, when given, is how
        many samples prompt i gets, 1 to sampling.n, and groups[i] holds that many (a new batch's
        prompts, n samples each, share the call with continued responses); `prefixes[i][j]`, when
        given, is the response so far of prompt i's sample j ([] for a new one): it goes on from
        there, its prompt prefilled once for all its samples, and only new tokens come back
        (sampling.max_tokens bounds the whole response). `finished(i, j, completion)`, when
        given, hears of prompt i's sample j as soon as it finishes, before the next `pause`, so
        a caller can hand it over at that boundary while the call goes on with its KV cache.
        `join()`, when given, is asked after every `pause` that answers False: it may return more
        prompts and their sample counts, which join the call (prompts that `fits_call` accepts).
        A `pause` may load new weights and answer False: the call goes on with its K/V, and each
        completion's `weight_epochs` says which tokens came after which load."""
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        if budgets is not None and (len(budgets) != len(prompts) or min(budgets, default=1) < 1):
            raise ValueError(f"budgets: one count >= 1 per prompt ({len(prompts)} prompts), got {budgets!r}")
        if samples is not None and (len(samples) != len(prompts) or not all(1 <= k <= sampling.n for k in samples)):
            raise ValueError(f"samples: one count in 1..n={sampling.n} per prompt ({len(prompts)} prompts), "
                             f"got {samples!r}")
        if prefixes is not None:
            self._check_prefixes(prefixes, samples or [sampling.n] * len(prompts), sampling.max_tokens)
        return self._generate(prompts, sampling, None, pause, every, budgets, samples, prefixes, finished, join)

    def fits_call(self, prompts: list[list[int]]) -> bool:
        """Prompts that may join the running pausable call (`join`): within the prompt length its
        K/V cache was allocated for (and Mistral's sliding window)."""
        if not all(len(p) <= self.cache.prompt_len for p in prompts):
            return False
        try:
            self.model._check_window(max(map(len, prompts), default=0) + (self.rows.max_tokens if self.rows else 0))
        except ValueError:
            return False
        return True

    def _check_prefixes(self, prefixes, samples: list[int], max_tokens: int) -> None:
        if self.record_routes:
            raise ValueError("prefixes: a continued response's routed experts are not recorded (R3): "
                             "give prompt + response as a prompt instead")
        if len(prefixes) != len(samples) or any(len(p) != k for p, k in zip(prefixes, samples)):
            raise ValueError(f"prefixes: one response so far per sample of each prompt ({samples} samples), "
                             f"got {[len(p) for p in prefixes]}")
        if any(len(r) >= max_tokens for p in prefixes for r in p):
            raise ValueError(f"prefixes: a response so far must be shorter than max_tokens={max_tokens}")

    @property
    def continues_responses(self) -> bool:
        """generate_pausable takes `prefixes` (not while R3 records routed experts)."""
        return not self.record_routes

    def _generate(self, prompts, sampling, prompt_limit, pause=None, every: int = 0,
                  budgets: list[int] | None = None, samples: list[int] | None = None,
                  prefixes: list[list[list[int]]] | None = None, finished=None, join=None) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling, prompt_limit)
        if not prompts:
            return []
        seed = sampling.seed
        if seed is None:                          # one random seed that every TP rank agrees on
            seed = self.comm.agree(int(torch.randint(0, 2**62, ()).item()))
        n, T = sampling.n, sampling.max_tokens
        P = max(map(len, prompts))
        self.model._check_window(P + T)           # Mistral: refuse what a sliding window would change
        cap_p, cap_t = P, T
        if self.decode.static:                    # rounded: fewer reallocations, so fewer recaptures
            cap_p, cap_t = -(-P // 64) * 64, -(-T // 64) * 64
        # Lengths never shrink (no reallocation for a shorter call); rows and groups follow
        # from them and the budget.
        cap_p, cap_t = max(cap_p, self.cache.prompt_len), max(cap_t, self.cache.gen_len)
        penalty = sampling.repetition_penalty != 1.0
        rows, groups = self._capacity(len(prompts), n, cap_p, cap_t, penalty,
                                      None if samples is None else (sum(samples), min(samples)))
        self.cache.ensure(rows, groups, cap_p, cap_t)
        if self.rows is None or not self.rows.fits(self.cache.rows, self.cache.groups, T, penalty):
            old = self.rows
            self.rows = None                      # free before allocating the bigger one
            self.rows = Rows(self.cache.rows, self.cache.groups, max(T, old.max_tokens if old else 0),
                             self.args.vocab_size, self.device, penalty or (old is not None and old.seen is not None))
        self._ensure_routes()
        self.model.rope(self.cache.prompt_len + self.cache.gen_len)   # the table a captured graph reads
        return Scheduler(self, prompts, sampling, seed, pause, every, budgets, samples, prefixes, finished,
                         join).run()

    def _ensure_routes(self) -> None:
        """R3's buffers, sized like the cache's rows and groups (dropped when recording is off)."""
        rows, c, a = self.rows, self.cache, self.args
        assert rows is not None                   # _generate sized them first
        if not self.record_routes:
            rows.routes = None
        elif rows.routes is None or not rows.routes.fits(c.rows, c.groups, rows.max_tokens, c.prompt_len):
            rows.routes = None                    # free before allocating the bigger one
            rows.routes = RouteRecord(c.rows, c.groups, rows.max_tokens, c.prompt_len, a.n_layers,
                                      a.num_experts_per_tok, self.routes_dtype, self.device)

    def _capacity(self, prompts: int, n: int, prompt_len: int, gen_len: int, penalty: bool,
                  mixed: tuple[int, int] | None = None) -> tuple[int, int]:
        """(rows, groups) for this call: max_num_seqs rows at most (and no more than the call
        needs), fewer where the KV cache and row state would not fit the memory budget:
        kv_cache_gb if set, on GPU gpu_memory_utilization of the device minus what is already
        allocated (what the engine itself holds counts as free); on CPU the same fraction of this
        rank's share of host memory minus the process's resident set (host_budget.py).
        `mixed` = (samples in all, fewest per prompt) where prompts get different counts."""
        wanted, fewest = mixed or (prompts * n, n)

        def groups(rows: int) -> int:             # see the module docstring
            return max(1, min(prompts, rows, -(-2 * rows // fewest)))
        rows = min(self.max_num_seqs, wanted)
        budget = self._budget_bytes()
        if budget is not None:
            per_row, per_group = self.row_costs(prompt_len, gen_len, penalty)

            def cost(r: int) -> float:
                return r * per_row + groups(r) * per_group
            rows = min(rows, int(budget // (per_row + min(1.0, 2 / fewest) * per_group)))   # about right
            while rows > n and cost(rows) > budget:                                      # exact
                rows -= 1
        else:                                     # unbounded: never shrink what is there
            rows = max(rows, self.cache.rows)
        rows = max(rows, n)
        if budget is not None and self.device.type != "cuda" and n * per_row + per_group > budget:
            raise host_budget.too_small(self, n, prompt_len, gen_len, n * per_row + per_group, budget)
        return rows, groups(rows)

    def row_costs(self, prompt_len: int, gen_len: int, penalty: bool = False) -> tuple[int, int]:
        """Bytes of one row (its K/V and row state) and of one prompt group."""
        per_token = self.cache.bytes_per_token()
        if self.record_routes:                    # R3's record: every token's expert ids
            per_token += RouteRecord.bytes_per_token(self.args.n_layers, self.args.num_experts_per_tok,
                                                     self.routes_dtype)
        return (per_token * gen_len + 6 * 8 + 12 * gen_len + (self.args.vocab_size if penalty else 0),
                per_token * prompt_len + 8)

    def _budget_bytes(self) -> float | None:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb * 2**30
        held = self.cache.nbytes()                # the engine's own cache and rows count as free
        if self.rows is not None:
            held += sum(t.numel() * t.element_size() for t in self.rows.tensors() + self.rows.group_tensors())
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            return self.gpu_memory_utilization * total - torch.cuda.memory_allocated(self.device) + held
        return host_budget.cpu_budget_bytes(self.gpu_memory_utilization, held)
