"""The rollout contract every engine implements (native, trtllm, vllm, hf, a user's class).

An engine implements three abstract methods (a class missing one is refused at construction,
Python's TypeError naming them); everything else the trainer calls or reads has a default here.

    engine.generate(prompts, sampling, prompt_limit=None)
                                       -> per prompt, n Completions (token ids, the log-prob of
                                          each sampled token, finish reason); prompt_limit: this
                                          call's longest prompt (None: rollout.prompt_length)
    engine.update_weights(bucket)      -> load one bucket of HF-named full tensors
    engine.finalize_weights()          -> all buckets are in: the new weights become active

    engine.generate_sequences(batch)   -> what the trainer calls: generate() over the batch's
                                          prompt_token_ids, packed per megarl/protocol.py
    engine.weight_shard(name)          -> optional: the part of a tensor this rank holds, so a sync
    engine.update_weight_shards(bucket)   can send just that part (None: full tensors only)
    engine.sleep() / engine.wake()     -> free / restore KV cache and weight memory
    engine.guard, .asleep, .weights    -> the state admit() checks before generating: the prompt
                                          guard, sleep, the last sync's completeness

Log-prob convention (shared with the actor's compute_log_prob): the log-prob of a sampled token
is log_softmax(logits / temperature) at that token, before top-k/top-p truncation and before the
repetition penalty; with temperature 0 (greedy) it is log_softmax(logits). So the trainer can
recompute it exactly from the same weights.

A user's class for `rollout.name=custom` subclasses BaseRollout (verl's) and overrides either
`generate` (token level) or `generate_sequences(batch) -> batch` (verl's form).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from megarl.config.dtypes import NAMES, canonical
from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState
from megarl.storage import plain_state

# "paused": a pausable engine stopped the sequence at a chunk boundary, unfinished (partial
# rollouts continue it: megarl/rollout/partial.py); never part of a finished rollout.
FinishReason = Literal["stop", "length", "abort", "paused"]


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                        # -1: off
    n: int = 1
    max_tokens: int = 16                   # the response budget
    stop_token_ids: list[int] = field(default_factory=list)  # always stop on these
    ignore_eos: bool = False               # True: keep going past eos_token_ids (stop_token_ids still stop)
    repetition_penalty: float = 1.0
    seed: int | None = None
    do_sample: bool = True                 # False: greedy whatever the temperature
    eos_token_ids: list[int] = field(default_factory=list)  # the tokenizer's EOS ids (stop unless ignore_eos)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Out-of-range values stop before anything runs, with the fix in the message."""
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)", "sampling.temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]", "sampling.top_p")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be -1 (off) or >= 1", "sampling.top_k")
        if self.n < 1:
            raise ConfigError(f"n={self.n} must be >= 1", "sampling.n")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 1", "sampling.max_tokens")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 = off)",
                              "sampling.repetition_penalty")

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end a response (the stop token is kept in the response)."""
        eos = () if self.ignore_eos else self.eos_token_ids
        return frozenset(self.stop_token_ids) | frozenset(eos)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are reported at (1.0 for greedy)."""
        return 1.0 if self.greedy else self.temperature

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)


plain_state.register_dataclass(SamplingParams)   # checkpoints hold the async loop's sampling


@dataclass(frozen=True)
class ShardSlice:
    """The part of a full HF tensor one engine rank holds: `full.narrow(dim, start, stop - start)`,
    or the whole tensor when dim is None (replicated)."""
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]                 # one per token of token_ids
    finish_reason: FinishReason
    # Multi-turn rollouts put tool output inside the response; those positions are 0 here.
    loss_mask: list[int] | None = None
    # R3 (rollout routing replay): the expert ids the engine's router chose, [m, MoE layers, top-k],
    # for the first m positions of prompt + token_ids that the engine fed through the model
    # (m < len(prompt) + len(token_ids): the final sampled token is never fed). None: not recorded.
    routed_experts: torch.Tensor | None = None
    # Per token of token_ids, how many weight loads the engine completed inside this call before
    # sampling it (a load between two chunks of a pausable call keeps the K/V computed so far).
    # None: no load landed inside the call while this sample ran.
    weight_epochs: list[int] | None = None


def rollout_dtype(name: str, device: torch.device) -> torch.dtype:
    """An engine's weights dtype from `rollout.dtype` (the trainer's is workers.preflight.resolve_dtype).
    `auto`: fp32 on CPU (log-probs exact to the trainer's), bf16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    known = canonical(name)
    if known is None:
        raise ValueError(f"rollout.dtype={name!r}: use auto, {NAMES}")
    return getattr(torch, known)


class RolloutEngine(ABC):
    """Token-level engine contract. Engines are built per rank by megarl.rollout.registry; one that
    implements the three abstract methods runs in the trainer as it is (the rest has defaults)."""

    # What a failed weight sync leaves (checkpoint_engine/base.py says it to the user): True, the
    # old weights while no bucket has reached the engine and a refusal to generate after; False,
    # a refusal to generate whatever was sent (an engine that rewrites weights as a sync starts).
    keeps_weights_on_failed_sync: bool = True
    # Between sleep() and wake(): admit() refuses to generate.
    asleep: bool = False

    # The state admit() reads is created on first use, so an engine whose __init__ never calls
    # super().__init__() still has it; an engine replaces either by assigning its own.
    @property
    def guard(self) -> PromptGuard:
        """The prompt checks run before generating (admit(), generate_sequences). Built-in engines
        assign PromptGuard(rollout.prompt_length, rollout.prompt_truncation, vocab_size=V); the
        default refuses empty prompts and strings and limits no length."""
        if "_guard" not in self.__dict__:
            self._guard = PromptGuard()
        return self._guard

    @guard.setter
    def guard(self, value: PromptGuard) -> None:
        self._guard = value

    @property
    def weights(self) -> WeightState:
        """The weight sync's bookkeeping (megarl/rollout/weight_state.py): admit() refuses to
        generate unless the last sync was complete. Engines that load in place assign
        WeightState(expected names, ready=False); the default expects no names and starts ready."""
        if "_weights" not in self.__dict__:
            self._weights = WeightState((), ready=True)
        return self._weights

    @weights.setter
    def weights(self, value: WeightState) -> None:
        self._weights = value

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        """For each prompt, `sampling.n` completions. `prompt_limit` replaces the configured prompt
        length for this call (the agent loop's continuations hold the response so far)."""

    @abstractmethod
    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage one bucket of HF-named full tensors. Not visible to generate() until finalize.
        The tensors may be views of a buffer the sender reuses after this call: copy what you keep."""

    @abstractmethod
    def finalize_weights(self) -> None:
        """Activate the staged weights; raise if any parameter was not received (never run on a mix)."""

    def weight_shard(self, name: str) -> ShardSlice | None:
        """Engines that shard their weights may accept pre-sharded input: return, for every HF
        tensor name, the part this rank holds, and implement update_weight_shards. A weight sync
        then sends each rank only its part (and can skip gathering what a trainer rank already
        holds). None (the default): this engine takes full tensors only."""
        return None

    def update_weight_shards(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Like update_weights, but each tensor is `weight_shard(name).take(full)`: exactly this
        rank's part. Only called on engines whose weight_shard() returns a ShardSlice."""
        raise NotImplementedError(f"{type(self).__name__} takes full tensors only (weight_shard() returns None)")

    def weight_view(self, name: str) -> torch.Tensor | None:
        """Engines that load in place may expose, for HF tensor `name`, the live storage of this
        rank's part of it (shape `weight_shard(name).take(full)`, contiguous), which a delta sync
        (checkpoint_engine/delta.py) writes changed elements into and checksums. None (the
        default): delta syncs are refused for this engine."""
        return None

    def begin_weight_delta(self) -> None:
        """A delta sync starts: the tensors it does not write keep their values. Raise when the
        engine does not hold the last sync's weights (the sync fails and the next one is full)."""
        raise NotImplementedError(f"{type(self).__name__} does not take delta weight syncs")

    def abort_weight_update(self) -> None:
        """A transfer failed: drop what was staged. Engines that stage keep the old weights active;
        engines that load in place (native, hf) refuse to generate until a full sync succeeds."""

    def sleep(self) -> None:
        """Release KV cache (and weights where the engine can restore them). An engine that
        overrides it sets `asleep` itself."""
        self.asleep = True

    def wake(self) -> None:
        """Undo sleep()."""
        self.asleep = False

    def generate_sequences(self, batch: DataProto) -> DataProto:
        """What the trainer calls (megarl/trainer/loop/generation.py): generate() over the batch's
        `prompt_token_ids` (meta_info: `sampling`, `pad_token_id`), packed per megarl/protocol.py.
        An engine that needs the rows themselves (raw prompts, tools) overrides it."""
        return generate_sequences_via(self, batch, batch.meta_info.get("pad_token_id", 0))


class BaseRollout(RolloutEngine):
    """What a user's custom class extends (`rollout.name=custom`, verl's BaseRollout).

    Override `generate_sequences(batch)` (batch in, batch with responses and log_probs out), or
    `generate` (token ids in, Completions out). Weight updates default to refusing, because a
    class that ignores new weights would silently train off-policy.
    """

    def __init__(self, config: Any = None, role: str = "rollout", **kwargs: Any):
        self.config = config
        self.role = role

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        raise NotImplementedError(f"{type(self).__name__} implements neither generate() nor generate_sequences()")

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot take new weights; implement update_weights() "
                                  "and finalize_weights() or train with rollout.name=native")

    def finalize_weights(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot take new weights")


def admit(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingParams,
          prompt_limit: int | None = None) -> list[list[int]]:
    """What an engine checks before generating (every built-in one does): sampling parameters, its prompt
    guard (refuse or left-truncate, at prompt_limit when given), that it is awake, and that its
    last weight sync completed."""
    sampling.validate()
    prompts = engine.guard.apply(prompts, max_length=prompt_limit)
    if engine.asleep:
        raise RuntimeError("rollout engine is asleep: call wake() before generate()")
    engine.weights.check_ready()
    return prompts


def generate_sequences_via(engine: RolloutEngine, batch: DataProto, pad_token_id: int) -> DataProto:
    """generate() over the batch's `prompt_token_ids`, packed per megarl/protocol.py. An engine's
    prompt guard runs first and the batch keeps the prompts as generated from (left-truncated
    ones included), so input_ids are what the trainer must score."""
    sampling: SamplingParams = batch.meta_info["sampling"]
    sampling.validate()
    prompts = guard_batch_prompts(engine.guard, batch,
                                  [list(p) for p in batch.non_tensor_batch["prompt_token_ids"]])
    groups = engine.generate(prompts, sampling)
    return pack_completions(batch, groups, pad_token_id=pad_token_id)


def guard_batch_prompts(guard, batch: DataProto, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's prompt guard over `prompts` (refuse or left-truncate), written back as the
    batch's `prompt_token_ids` so the trainer scores exactly what was generated from. Idempotent:
    the engine's generate() applying the guard again changes nothing. No guard: as given."""
    if guard is not None:
        prompts = guard.apply(prompts)
    kept = np.empty(len(prompts), dtype=object)
    for i, p in enumerate(prompts):
        kept[i] = list(p)
    batch.non_tensor_batch["prompt_token_ids"] = kept
    return prompts


def pack_completions(batch: DataProto, groups: list[list[Completion]], pad_token_id: int) -> DataProto:
    """Rows of `batch` (one per prompt) x n completions -> the rollout fields of megarl/protocol.py.

    Row order: the n samples of prompt i are adjacent (batch.repeat(n, interleave=True)).
    """
    n = len(groups[0]) if groups else 1
    if any(len(g) != n for g in groups):
        raise ValueError("every prompt must get the same number of completions")
    out = batch.repeat(n, interleave=True)
    comps = [c for g in groups for c in g]
    prompts = [list(p) for p in out.non_tensor_batch["prompt_token_ids"]]
    width = max([len(c.token_ids) for c in comps] + [1])
    seq_width = max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps))
    B = len(comps)
    responses = torch.full((B, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    logp = torch.zeros((B, width), dtype=torch.float32)
    input_ids = torch.full((B, seq_width), pad_token_id, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        r = len(c.token_ids)
        if len(c.log_probs) != r:
            raise ValueError(f"completion {i}: {len(c.log_probs)} log-probs for {r} tokens")
        responses[i, :r] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :r] = torch.tensor(c.loss_mask if c.loss_mask is not None else [1] * r, dtype=torch.long)
        logp[i, :r] = torch.tensor(c.log_probs, dtype=torch.float32)
        input_ids[i, :len(p) + r] = torch.tensor(p + c.token_ids, dtype=torch.long)
    out.batch["responses"] = responses
    out.batch["response_mask"] = mask
    out.batch["rollout_log_probs"] = logp
    out.batch["input_ids"] = input_ids
    out.batch["prompt_lens"] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    out.batch["response_lens"] = torch.tensor([len(c.token_ids) for c in comps], dtype=torch.long)
    out.non_tensor_batch["finish_reasons"] = np.array([c.finish_reason for c in comps], dtype=object)
    routes = [c.routed_experts for c in comps]
    if any(r is not None for r in routes):
        out.batch["routed_experts"] = pack_routes(routes, [len(p) + len(c.token_ids) for p, c in zip(prompts, comps)],
                                                  seq_width)
    return out


def pack_routes(routes: list[torch.Tensor | None], lengths: list[int], width: int) -> torch.Tensor:
    """Per-sequence routes [m_i, L, K] -> `routed_experts` [B, width, L, K], aligned with input_ids.

    Positions m_i..lengths[i]-1 had no record (the final sampled token is never fed; nor is a
    multi-turn trajectory's trailing tool output): they get a copy of position m_i - 1's routes.
    Exact for the trainer's log-probs: attention is causal, so a position's routes change only its
    own and later positions' outputs, and nothing scored comes after them. Padding holds 0."""
    if any(r is None for r in routes):
        raise ValueError("routed_experts: some completions carry routes and others none; an engine "
                         "records them for every sequence of a call or for none")
    first = routes[0]
    out = torch.zeros(len(routes), width, *first.shape[1:], dtype=first.dtype)
    for i, (r, n) in enumerate(zip(routes, lengths)):
        m = min(len(r), n)
        if m < 1:
            raise ValueError(f"routed_experts: sequence {i} has no recorded position")
        out[i, :m] = r[:m]
        out[i, m:n] = r[m - 1]
    return out
