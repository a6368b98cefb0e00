"""The agent loop: multi-turn rollouts with tool calls over any token-level engine.

    loop = AgentLoop(engine, tokenizer, tools, cfg.rollout.multi_turn)
    out = loop.generate_sequences(batch)       # as an engine's; plus per-sample tool records
    loop.update_weights(...), loop.sleep() ... # the rollout contract, passed to loop.engine by name

One round: every active trajectory's next turn goes to the engine in one generate() call (the
first turn with n samples per prompt; later turns one continuation each, n=1, prompt = original
prompt + everything so far, a seed per turn). Each turn is cut after its max_parallel_calls-th
</tool_call>, the calls of all trajectories run together, and their output (truncated per
max_tool_response_length) is appended. A trajectory ends when a turn has no call, at
max_assistant_turns, or when its response budget (sampling.max_tokens: model and tool tokens
together) is spent.

The Completion of a trajectory: token_ids = every token after the prompt, log_probs the engine's
for model tokens and 0 for tool/user tokens, loss_mask 1 on model tokens only; finish_reason
"stop" (the model finished), "length" (the budget or max_assistant_turns cut it short).

Stopping at </tool_call>: when it is one token (Qwen2.5/Qwen3) it is a stop token of the turn;
otherwise the turn runs to EOS or the budget and the text after the call is dropped, which costs
the tokens generated past the call (one EOS for a model trained on the format). Every turn
re-prefills its whole context (no prefix cache across turns), so a turn costs prompt + response
so far of prefill.

R3 (routed experts): every turn's prompt is the whole context, so its prefill routes every
earlier token, tool and user output included, under the current weights; a trajectory keeps its
latest turn's record, which covers everything before that turn's last sampled token. Tool output
appended after the last turn has no record: pack_completions copies the last recorded position
into it (nothing scored follows it, and attention is causal).

Under rollout TP every rank of the group runs this loop on the same inputs; tools and simulated
users run on the group's first rank and their output is broadcast, so all ranks continue alike.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.rollout.base import (Completion, RolloutEngine, SamplingParams, ShardSlice, guard_batch_prompts,
                                 pack_completions)
from megarl.rollout.config import MultiTurnConfig
from megarl.reward.scoring import RewardExit, exits_refused
from megarl.rollout.multiturn.executor import ToolExecutor, ToolResult, UserCodeExit
from megarl.rollout.multiturn.interactions import pick
from megarl.rollout.multiturn.parser import CLOSE, ToolCall, end_of_call, parse_tool_calls
from megarl.rollout.multiturn.render import Renderer, truncate_tokens
from megarl.rollout.multiturn.tools import Tool
from megarl.rollout.sampling import mix64


@dataclass
class Trajectory:
    prompt: list[int]
    budget: int
    sample: dict = field(default_factory=dict)     # data_source, ground_truth, extra_info, raw_prompt
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0                                 # assistant turns
    user_turns: int = 0
    calls: list[dict] = field(default_factory=list)   # {name, arguments, status, turn}
    tool_tokens: int = 0
    truncated_outputs: int = 0
    max_turns_hit: bool = False
    finish: str | None = None
    routes: Any = None                             # R3: the latest turn's routed_experts (covers all before it)

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def add(self, ids: list[int], log_probs: list[float] | None) -> None:
        """Model tokens (with their log-probs) or, with log_probs None, tool/user tokens."""
        self.tokens += ids
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.mask += [1 if log_probs is not None else 0] * len(ids)

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.log_probs), self.finish or "length", list(self.mask),
                          routed_experts=self.routes)


def turn_seed(seed: int, turn: int) -> int:
    return mix64(mix64(seed) ^ (0xA5A5 + turn)) & ((1 << 62) - 1)


class AgentLoop(RolloutEngine):
    """The rollout contract (megarl/rollout/base.py) over a wrapped engine: generation runs the
    loop, every other call goes to the engine by name (a weight sync reaches the engine's
    weight_shard through weight_shard() below)."""

    def __init__(self, engine, tokenizer, tools: dict[str, Tool], config: MultiTurnConfig | None = None, *,
                 template: str | None = None, interactions: dict | None = None, tp_group=None,
                 prompt_template: str | None = None, stop_at_call_token: bool = True):
        self.engine, self.tok, self.tools = engine, tokenizer, tools
        self.cfg = config or MultiTurnConfig(enable=True)
        self.interactions = interactions or {}
        self.renderer = Renderer(tokenizer, template, self.cfg.tool_response_render)
        self.executor = ToolExecutor(tools, self.cfg.tool_timeout_s, self.cfg.tool_workers, self.cfg.tool_backend)
        close = tokenizer.encode(CLOSE, add_special_tokens=False)
        # One-token </tool_call> can stop a turn in the engine; with several calls per turn it must not.
        self.call_stop = close[0] if (stop_at_call_token and len(close) == 1 and self.cfg.max_parallel_calls == 1) \
            else None
        self.prompt_template = prompt_template     # re-render chat prompts with the tool list (tools_in_prompt)
        self.group = tp_group
        self.totals: Counter = Counter()

    # -- the rest of the rollout contract: the wrapped engine's ------------------------------------------
    guard = property(lambda self: self.engine.guard)              # the state admit() reads
    asleep = property(lambda self: self.engine.asleep)
    weights = property(lambda self: self.engine.weights)

    def weight_shard(self, name: str) -> ShardSlice | None:
        return self.engine.weight_shard(name)

    def update_weight_shards(self, bucket) -> None:
        self.engine.update_weight_shards(bucket)

    def update_weights(self, bucket) -> None:
        self.engine.update_weights(bucket)

    def finalize_weights(self) -> None:
        self.engine.finalize_weights()

    def abort_weight_update(self) -> None:
        self.engine.abort_weight_update()

    @property
    def keeps_weights_on_failed_sync(self) -> bool:          # type: ignore[override]
        return self.engine.keeps_weights_on_failed_sync

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.executor.close()

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        trajs = self.run(prompts, sampling, [{}] * len(prompts), prompt_limit)
        n = sampling.n
        return [[t.completion() for t in trajs[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def generate_sequences(self, batch: DataProto) -> DataProto:
        """A prompt batch (prompt_token_ids, meta sampling / pad_token_id) -> the protocol's fields plus
        per-sample num_turns, user_turns, tool_calls (records), tool_tokens; meta_info["metrics"]."""
        sampling: SamplingParams = batch.meta_info["sampling"]
        sampling.validate()
        nt = batch.non_tensor_batch
        prompts = self._with_tool_list(batch, [list(p) for p in nt["prompt_token_ids"]])
        prompts = guard_batch_prompts(self.guard, batch, prompts)
        rows = [{k: (nt[k][i] if k in nt else None)
                 for k in ("data_source", "reward_model", "extra_info", "raw_prompt")}
                for i in range(len(prompts))]
        for r in rows:
            rm = r.pop("reward_model")
            r["ground_truth"] = rm.get("ground_truth") if isinstance(rm, dict) else rm
        started = time.perf_counter()
        trajs = self.run(prompts, sampling, rows)
        n = sampling.n
        groups = [[t.completion() for t in trajs[i * n:(i + 1) * n]] for i in range(len(prompts))]
        out = pack_completions(batch, groups, pad_token_id=batch.meta_info.get("pad_token_id", 0))
        ont = out.non_tensor_batch
        ont["num_turns"] = np.array([t.turns for t in trajs], dtype=object)
        ont["user_turns"] = np.array([t.user_turns for t in trajs], dtype=object)
        ont["tool_tokens"] = np.array([t.tool_tokens for t in trajs], dtype=object)
        records = np.empty(len(trajs), dtype=object)
        for i, t in enumerate(trajs):
            records[i] = list(t.calls)
        ont["tool_calls"] = records
        if "extra_info" in ont:               # what a compute_score(..., extra_info) can check
            infos = np.empty(len(trajs), dtype=object)
            for i, (info, t) in enumerate(zip(ont["extra_info"], trajs)):
                infos[i] = {**(info if isinstance(info, dict) else {}), "tool_calls": list(t.calls),
                            "num_turns": t.turns}
            ont["extra_info"] = infos
        out.meta_info["metrics"] = {**multiturn_metrics(out), "timing_s/agent_loop": time.perf_counter() - started}
        return out

    def run(self, prompts: list[list[int]], sampling: SamplingParams, samples: list[dict],
            prompt_limit: int | None = None) -> list[Trajectory]:
        """n trajectories per prompt (the n of prompt i adjacent), finished."""
        stops = list(sampling.stop_token_ids) + ([self.call_stop] if self.call_stop is not None else [])
        eos = set(sampling.eos_token_ids) | ({self.tok.eos_token_id} if self.tok.eos_token_id is not None else set())
        first = self.engine.generate(prompts, sampling.with_(stop_token_ids=stops), prompt_limit)
        # Later turns' prompts hold the response so far: the first turn's limit plus the response
        # budget (the original prompts were checked already).
        limit = prompt_limit if prompt_limit is not None else getattr(self.guard, "max_length", None)
        later_limit = None if limit is None else limit + sampling.max_tokens
        trajs = [Trajectory(list(p), sampling.max_tokens, samples[i]) for i, p in enumerate(prompts)
                 for _ in range(sampling.n)]
        turns = [c for group in first for c in group]
        active = list(trajs)
        round_ = 0
        while active:
            round_ += 1
            pending: list[tuple[Trajectory, list[ToolCall], bool]] = []
            talking: list[tuple[Trajectory, str, bool]] = []
            for t, c in zip(active, turns):
                calls, text, after_eos = self._take_turn(t, c, eos)
                if calls:
                    pending.append((t, calls, after_eos))
                elif t.finish is None:
                    talking.append((t, text, after_eos))
            self._run_tools(pending)
            self._run_users(talking)
            active = [t for t in trajs if t.finish is None]
            if not active:
                break
            seed = None if sampling.seed is None else turn_seed(sampling.seed, round_)
            sp = sampling.with_(n=1, seed=seed, max_tokens=max(t.room for t in active), stop_token_ids=stops)
            outs = self.engine.generate([t.prompt + t.tokens for t in active], sp, later_limit)
            turns = [g[0] for g in outs]
        self.totals["trajectories"] += len(trajs)
        return trajs

    # -- one assistant turn ---------------------------------------------------------------------------
    def _take_turn(self, t: Trajectory, c: Completion, eos: set[int]) -> tuple[list[ToolCall], str, bool]:
        """Append the model's turn; return (calls to run, the turn's text, whether it ended with EOS)."""
        toks, lps, reason = list(c.token_ids), list(c.log_probs), c.finish_reason
        if len(toks) > t.room:                   # one call serves several budgets: cut to this one's
            toks, lps, reason = toks[:t.room], lps[:t.room], "length"
        t.turns += 1
        k = self.cfg.max_parallel_calls
        text = self.tok.decode(toks, skip_special_tokens=False) if (self.tools or self.interactions) else ""
        calls: list[ToolCall] = []
        if self.tools:
            end = end_of_call(text, k)
            if end is not None and end < len(text):     # text (or EOS) after the k-th call: dropped
                cut = self._prefix_with_calls(toks, k)
                toks, lps, reason = toks[:cut], lps[:cut], "stop"
                text = self.tok.decode(toks, skip_special_tokens=False)
            calls = parse_tool_calls(text)
            if reason == "length":                # an unclosed call at the budget's end: nothing to answer
                calls = [cl for cl in calls if not (cl.error and "was not closed" in cl.error)]
        if c.routed_experts is not None:      # this turn's prefill re-routed everything before it
            t.routes = c.routed_experts[:len(t.prompt) + len(t.tokens) + len(toks)]
        t.add(toks, lps)
        after_eos = bool(toks) and toks[-1] in eos
        if reason == "abort":
            t.finish = "abort"
            return [], text, after_eos
        if calls:
            if t.room <= 0:
                t.finish = "length"
            elif self.cfg.max_assistant_turns is not None and t.turns >= self.cfg.max_assistant_turns:
                t.finish, t.max_turns_hit = "length", True
            else:
                return calls, text, after_eos
            return [], text, after_eos
        if reason == "length":
            t.finish = "length"
        return [], text, after_eos

    def _prefix_with_calls(self, toks: list[int], k: int) -> int:
        """The fewest tokens whose text holds k complete calls (binary search over decodes)."""
        lo, hi = 1, len(toks)
        while lo < hi:
            mid = (lo + hi) // 2
            if end_of_call(self.tok.decode(toks[:mid], skip_special_tokens=False), k) is None:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- tools and users ---------------------------------------------------------------------------------
    def _agree(self, value):
        """Rank 0 of the rollout TP group's value on every rank of it."""
        if self.group is None:
            return value
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _leader(self) -> bool:
        if self.group is None:
            return True
        return not dist.is_initialized() or dist.get_rank(self.group) == 0

    def _run_tools(self, pending: list[tuple[Trajectory, list[ToolCall], bool]]) -> None:
        if not pending:
            return
        k = self.cfg.max_parallel_calls
        flat = [c for _, calls, _ in pending for c in calls[:k]]
        rows = [_tools_kwargs(t) for t, calls, _ in pending for _ in calls[:k]]
        results = self._agree(self.executor.run(flat, rows) if self._leader() else None)
        it = iter(results)
        for t, calls, after_eos in pending:
            outs: list[ToolResult] = [next(it) for _ in calls[:k]]
            outs += [ToolResult(f"Error: only {k} tool call(s) run per turn (multi_turn.max_parallel_calls)",
                                "over_limit") for _ in calls[k:]]
            texts = []
            for call, res in zip(calls, outs):
                t.calls.append({"name": call.name, "arguments": call.arguments, "status": res.status, "turn": t.turns})
                self.totals[res.status] += 1
                text, cut = truncate_tokens(self.tok, res.text, self.cfg.max_tool_response_length,
                                            self.cfg.tool_response_truncate_side)
                t.truncated_outputs += cut
                texts.append(text)
            ids = self.renderer.tool_tokens(texts, after_eos)
            if len(ids) >= t.room:
                ids, t.finish = ids[:t.room], "length"
            t.add(ids, None)
            t.tool_tokens += len(ids)

    def _run_users(self, talking: list[tuple[Trajectory, str, bool]]) -> None:
        limit = self.cfg.max_user_turns if self.cfg.max_user_turns is not None else 1
        asks = []
        for t, text, after_eos in talking:
            fn = pick(self.interactions, t.sample.get("extra_info"))
            more = self.cfg.max_assistant_turns is None or t.turns < self.cfg.max_assistant_turns
            if fn is None or t.user_turns >= limit or t.room <= 0 or not more:
                t.finish = "stop"
            else:
                asks.append((t, fn, text, after_eos))
        if not asks:
            return
        replies = self._agree([_ask(fn, text, t) for t, fn, text, _ in asks] if self._leader() else None)
        for (t, _, _, after_eos), reply in zip(asks, replies):
            if reply is None:
                t.finish = "stop"
                continue
            ids = self.renderer.user_tokens(str(reply), after_eos)
            if len(ids) >= t.room:
                ids, t.finish = ids[:t.room], "length"
            t.add(ids, None)
            t.user_turns += 1

    # -- prompts ---------------------------------------------------------------------------------------
    def _with_tool_list(self, batch: DataProto, prompts: list[list[int]]) -> list[list[int]]:
        """Chat prompts re-rendered with tools=... so the template lists them (tools_in_prompt)."""
        nt = batch.non_tensor_batch
        if not (self.tools and self.prompt_template and "raw_prompt" in nt):
            return prompts
        schemas = [tool.schema for tool in self.tools.values()]
        out = []
        for raw in nt["raw_prompt"]:
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
            text = self.tok.apply_chat_template(messages, tools=schemas, chat_template=self.prompt_template,
                                                tokenize=False, add_generation_prompt=True)
            out.append(self.tok.encode(text, add_special_tokens=False))
        return out


def _ask(fn, text: str, t: Trajectory):
    """An interaction's reply; one that tries to end the process stops the run naming it, not as a success."""
    try:
        with exits_refused():
            return fn(text, sample=t.sample, turn=t.turns)
    except RewardExit as err:
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        raise UserCodeExit(f"interaction {getattr(fn, '__module__', '')}.{name} {err} while replying; an "
                           "interaction must return its reply (or None), not end the process") from None


def _tools_kwargs(t: Trajectory):
    """The row's extra_info.tools_kwargs, where verl's dataset reads it from."""
    info = t.sample.get("extra_info")
    return info.get("tools_kwargs") if isinstance(info, dict) else None


def multiturn_metrics(batch: DataProto) -> dict[str, float]:
    """Tool-use metrics of a rolled-out batch (from its per-sample fields, so they are right for the
    whole batch after the rollout groups' outputs are gathered)."""
    nt = batch.non_tensor_batch
    if "tool_calls" not in nt:
        return {}
    turns = np.array([int(x) for x in nt["num_turns"]], dtype=float)
    tool_tokens = np.array([int(x) for x in nt["tool_tokens"]], dtype=float)
    statuses = Counter(c["status"] for calls in nt["tool_calls"] for c in calls)
    n_calls = sum(statuses.values())
    resp = batch.batch["response_lens"].float().sum().item() if "response_lens" in batch.batch else 0.0
    out = {"multiturn/assistant_turns/mean": float(turns.mean()), "multiturn/assistant_turns/max": float(turns.max()),
           "multiturn/tool_calls/mean": n_calls / max(len(turns), 1), "multiturn/tool_calls/total": float(n_calls),
           "multiturn/tool_errors": float(n_calls - statuses["ok"]),
           "multiturn/tool_error_rate": (n_calls - statuses["ok"]) / max(n_calls, 1),
           "multiturn/tool_tokens/mean": float(tool_tokens.mean()),
           "multiturn/tool_token_fraction": float(tool_tokens.sum()) / max(resp, 1.0),
           "multiturn/user_turns/mean": float(np.mean([int(x) for x in nt["user_turns"]]))}
    for status in ("timeout", "error", "parse_error", "unknown_tool", "no_implementation", "bad_arguments"):
        out[f"multiturn/tool_{status}"] = float(statuses[status])
    return out
