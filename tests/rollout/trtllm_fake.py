"""A conformance fake of `tensorrt_llm`, built from one API snapshot (tests/assets/trtllm/*.json).

FAKE, because tensorrt_llm cannot run here (no CUDA; its wheel comes from NVIDIA's index). It is
as strict as the snapshot: SamplingParams is a dataclass of exactly the snapshot's init fields
(an unknown keyword is Python's own TypeError), LLM / KvCacheConfig / SleepConfig reject unknown
arguments with a ValueError as TensorRT-LLM's pydantic models do, greedy n>1 raises as 1.2's
_validate does, and log-probs come back in the snapshot's format (1.2: top-K dicts in which the
sampled token may be absent; 1.3: the sampled token plus the top K, or one float with
logprobs_simple_format). Generation is real: a transformers model, step by step in fp32, so
tokens and log-probs are exact. Workers are simulated: one per TP rank, on the GPUs that
CUDA_VISIBLE_DEVICES names when the LLM starts (as TensorRT-LLM's own Ray instance would see),
or on `FakeCluster.gpus` without it. A byte ledger follows what would be resident on the GPU
(weights, KV cache, a bucket in flight) to check the order of wake and refit.
"""
from __future__ import annotations

import base64
import dataclasses
import enum
import json
import os
import pickle
import sys
import types
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "trtllm"
SNAPSHOTS = sorted(p.name for p in ASSETS.glob("trtllm-*.json"))
KV_BYTES = 1 << 20                          # the fake KV cache's size in the ledger


def load_snapshot(name: str) -> dict:
    return json.loads((ASSETS / name).read_text())


class FakeCluster:
    """Where simulated workers land when CUDA_VISIBLE_DEVICES is unset."""
    gpus: list[str] = [f"GPU-fake-{i}" for i in range(8)]


def _strict_model(name: str, fields: list[str]):
    """A pydantic-like config class: keyword arguments, unknown ones rejected."""
    allowed = frozenset(fields)

    def __init__(self, **kw):
        extra = sorted(set(kw) - allowed)
        if extra:
            raise ValueError(f"1 validation error for {name}\n{extra[0]}\n  Extra inputs are not permitted")
        self.__dict__.update(kw)

    def __eq__(self, other):
        return type(self) is type(other) and self.__dict__ == other.__dict__

    return type(name, (), {"__init__": __init__, "__eq__": __eq__, "model_fields": {f: None for f in fields}})


DEFAULTS = {"max_tokens": 32, "n": 1, "include_stop_str_in_output": False, "detokenize": True,
            "use_beam_search": False, "logprobs_simple_format": False, "prompt_logprobs_simple_format": False,
            "exclude_input_from_output": True, "add_special_tokens": True, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "ignore_eos": False, "apply_batched_logits_processor": False,
            "return_context_logits": False, "return_generation_logits": False, "return_encoder_output": False,
            "return_perf_metrics": False}


def _sampling_params_class(snap: dict):
    modes = snap.get("logprobs_modes")

    def __post_init__(self):
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        self.best_of = self.best_of or self.n
        greedy = ((self.temperature is None and self.top_p is None and self.top_k is None)
                  or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0)
        if self.best_of > 1 and greedy and not os.environ.get(snap.get("greedy_n_env", "TLLM_ALLOW_N_GREEDY_DECODING")):
            raise ValueError(f"Greedy decoding in the LLM API does not allow multiple returns. Please set to "
                             f"best_of=1, got best_of={self.best_of}.")
        if modes is not None and self.logprobs_mode is not None and str(self.logprobs_mode) not in modes:
            raise ValueError(f"logprobs_mode must be one of {modes}, got {self.logprobs_mode!r}")

    fields = [(f, object, dataclasses.field(default=DEFAULTS.get(f))) for f in snap["sampling_params_fields"]]
    return dataclasses.make_dataclass("SamplingParams", fields, kw_only=True,
                                      namespace={"__post_init__": __post_init__})


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None


def _completion_class(snap: dict):
    fields = [(f, object, dataclasses.field(default=None)) for f in snap["completion_output_fields"]]
    return dataclasses.make_dataclass("CompletionOutput", fields)


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list
    finished: bool = True


class _LLM:
    """Stands in for tensorrt_llm.LLM (class attributes set per snapshot by `build`)."""
    snap: dict = {}
    mod: types.ModuleType = None
    instances: list = []

    def __init__(self, **kwargs):
        extra = sorted(set(kwargs) - set(self.snap["llm_args_fields"]))
        if extra:
            raise ValueError(f"1 validation error for TorchLlmArgs\n{extra[0]}\n  Extra inputs are not permitted")
        self.kwargs = kwargs
        self.tp = kwargs.get("tensor_parallel_size", 1)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else FakeCluster.gpus
        if len(gpus) < self.tp:
            raise RuntimeError(f"Ray sees {len(gpus)} GPU(s) for tensor_parallel_size={self.tp}")
        self.workers = gpus[:self.tp]
        from transformers import AutoConfig, AutoModelForCausalLM
        path = kwargs["model"]
        if kwargs.get("load_format", "auto") == "dummy":
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.model.float()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.released: set[str] = set()
        self.sleep_modes = self._restore_modes(kwargs)
        self.events: list = []
        self.resident = self.weight_bytes + KV_BYTES
        self.peak = self.resident
        self.rpcs: list = []
        self.shut = False
        type(self).instances.append(self)

    def _restore_modes(self, kwargs) -> dict | None:
        if "sleep_config" in kwargs:
            modes = {m.value if isinstance(m, enum.Enum) else m: v
                     for m, v in kwargs["sleep_config"].restore_modes.items()}
            allowed = set(self.snap.get("restore_modes") or ["NONE", "PINNED"])
            bad = sorted(set(modes.values()) - allowed)
            if bad:
                raise ValueError(f"unknown restore mode(s) {bad}")
            return modes
        if kwargs.get("enable_sleep"):
            return {}
        return None

    # -- the ledger ----------------------------------------------------------------------------
    def _account(self, delta: int, what: str) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)
        self.events.append((what, self.resident))

    # -- RPCs --------------------------------------------------------------------------------------
    def _collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        if method == "report_device_id":
            return list(self.workers)
        if method == "update_weights":
            self._update_weights(args[0])     # every worker loads the same full tensors
            return [None] * len(self.workers)
        if method in ("sleep", "wakeup"):
            return self._sleep(args[0]) if method == "sleep" else self._wakeup(args[0])
        if method == "reset_prefix_cache":
            return [None] * len(self.workers)
        raise AttributeError(f"the workers have no method {method!r}")

    def _update_weights(self, handles):
        if "model" in self.released:
            raise RuntimeError("CUDA error: an illegal memory access (weights released, not resumed)")
        if handles is None:
            return None
        for uuid in self.workers:
            if uuid not in handles:
                raise ValueError(f"Device UUID {uuid} not found in ipc_handles")
        blob = pickle.loads(base64.b64decode(handles[self.workers[0]]))
        state = dict(self.model.named_parameters())
        bucket = 0
        for name, (rebuild, rebuild_args) in blob:
            tensor = rebuild(*rebuild_args)
            if name not in state:
                raise KeyError(f"no parameter {name} in the model")
            bucket += tensor.numel() * tensor.element_size()
            with torch.no_grad():
                state[name].copy_(tensor)
        self._account(bucket, "bucket in")
        self._account(-bucket, "bucket out")
        return None

    def _sleep(self, tags):
        if self.sleep_modes is None:
            raise RuntimeError("sleep() needs the engine built with sleep support (sleep_config / enable_sleep)")
        valid = set(self.snap["executor_memory_types"])
        bad = sorted(set(tags) - valid)
        if bad:
            raise ValueError(f"unknown memory tag(s) {bad}")
        for tag in tags:
            if tag in self.released:
                continue
            self.released.add(tag)
            if tag == "model":
                self._account(-self.weight_bytes, "release model")
                if self.sleep_modes.get(tag, "PINNED") == "PINNED":
                    self.events.append(("host copy model", self.weight_bytes))
            elif tag == "kv_cache":
                self._account(-KV_BYTES, "release kv_cache")
        return [None] * len(self.workers)

    def _wakeup(self, tags):
        for tag in tags:
            if tag not in self.released:
                continue
            self.released.discard(tag)
            if tag == "model":
                self._account(self.weight_bytes, "resume model")
                if self.sleep_modes.get(tag, "PINNED") == "NONE":    # contents not kept
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.fill_(float("nan"))
                else:
                    self.events.append(("host copy model", self.weight_bytes))
            elif tag == "kv_cache":
                self._account(KV_BYTES, "resume kv_cache")
        return [None] * len(self.workers)

    def shutdown(self):
        self.shut = True

    # -- generation ------------------------------------------------------------------------------
    def generate(self, inputs, sampling_params=None):
        if {"model", "kv_cache"} & self.released:
            raise RuntimeError(f"generate() while {sorted(self.released)} are released")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError("one SamplingParams per prompt")
        return [self._one(list(p), sp) for p, sp in zip(inputs, params)]

    @torch.no_grad()
    def _one(self, prompt, sp):
        max_len = self.kwargs.get("max_seq_len")
        if max_len is not None and len(prompt) + sp.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({sp.max_tokens}) > max_seq_len ({max_len})")
        outs = []
        for j in range(sp.best_of):
            gen = torch.Generator().manual_seed((sp.seed or 0) * 1000 + j)
            toks, entries, reason = [], [], "length"
            out = self.model(torch.tensor([prompt]), use_cache=True)
            for _ in range(sp.max_tokens):
                if toks:
                    out = self.model(torch.tensor([toks[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                logits = out.logits[0, -1].float()
                raw = torch.log_softmax(logits, -1)
                proc_logits = logits.clone()
                if sp.repetition_penalty not in (None, 1.0):
                    seen = torch.tensor(sorted(set(prompt + toks)))
                    vals = proc_logits[seen]
                    proc_logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty,
                                                    vals * sp.repetition_penalty)
                greedy = sp.temperature in (None, 0) or sp.top_k == 1
                if greedy:
                    tok = int(proc_logits.argmax())
                    processed = torch.log_softmax(proc_logits, -1)
                else:
                    proc_logits = proc_logits / sp.temperature
                    if sp.top_k:
                        kth = proc_logits.topk(sp.top_k).values[-1]
                        proc_logits[proc_logits < kth] = float("-inf")
                    if sp.top_p is not None and sp.top_p < 1:
                        order = proc_logits.argsort(descending=True)
                        cum = torch.softmax(proc_logits[order], -1).cumsum(-1)
                        drop = order[(cum - torch.softmax(proc_logits[order], -1)) > sp.top_p]
                        proc_logits[drop] = float("-inf")
                    processed = torch.log_softmax(proc_logits, -1)
                    tok = int(torch.multinomial(processed.exp(), 1, generator=gen))
                toks.append(tok)
                entries.append(self._logprobs(tok, raw, processed, sp))
                if sp.stop_token_ids and tok in sp.stop_token_ids:
                    reason = "stop"
                    break
                if sp.end_id not in (None, -1) and tok == sp.end_id:
                    reason = "stop"
                    break
            if reason == "stop" and not sp.include_stop_str_in_output:
                toks, entries = toks[:-1], entries[:-1]
            outs.append(self.mod.CompletionOutput(index=j, token_ids=toks, logprobs=entries if sp.logprobs else [],
                                                  finish_reason=reason))
        return RequestOutput(prompt_token_ids=prompt, outputs=outs[:sp.n])

    def _logprobs(self, tok, raw, processed, sp):
        if not sp.logprobs:
            return None
        if self.snap.get("logprobs_modes") is None:
            # 1.2: the top-K only; the sampled token is there only when it ranks in the top K.
            values = raw
            top = values.topk(sp.logprobs)
            return {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}
        values = processed if str(sp.logprobs_mode) == "processed" else raw
        if sp.logprobs_simple_format:
            return float(values[tok])
        top = values.topk(sp.logprobs)
        out = {tok: Logprob(float(values[tok]), int((values > values[tok]).sum()) + 1)}
        for r, (v, t) in enumerate(zip(top.values, top.indices)):
            out.setdefault(int(t), Logprob(float(v), r + 1))
        return out


def build(snapshot_name: str) -> dict[str, types.ModuleType]:
    """The fake package's modules for one snapshot: {module name: module} for sys.modules."""
    snap = load_snapshot(snapshot_name)
    root = types.ModuleType("tensorrt_llm")
    root.__version__ = snap["version"]
    root.__path__ = []
    llm_cls = type("LLM", (_LLM,), {"snap": snap, "mod": root, "instances": []})
    root.LLM = llm_cls
    root.SamplingParams = _sampling_params_class(snap)
    root.CompletionOutput = _completion_class(snap)
    args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    args.TorchLlmArgs = _strict_model("TorchLlmArgs", snap["llm_args_fields"])
    args.KvCacheConfig = _strict_model("KvCacheConfig", snap["kv_cache_config_fields"])
    if snap.get("sleep_config_fields"):
        args.SleepConfig = _strict_model("SleepConfig", snap["sleep_config_fields"])
    if snap.get("ray_placement_config_fields"):
        args.RayPlacementConfig = _strict_model("RayPlacementConfig", snap["ray_placement_config_fields"])
    args.ExecutorMemoryType = enum.Enum("ExecutorMemoryType",
                                        {t.upper(): t for t in snap["executor_memory_types"]}, type=str)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.__path__ = []
    llmapi.llm_args = args
    llmapi.KvCacheConfig = args.KvCacheConfig
    llmapi.SamplingParams = root.SamplingParams
    root.llmapi = llmapi
    utils = types.ModuleType("tensorrt_llm._torch.utils")
    utils.get_device_uuid = lambda index: FakeCluster.gpus[index]
    torch_pkg = types.ModuleType("tensorrt_llm._torch")
    torch_pkg.__path__ = []
    torch_pkg.utils = utils
    return {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm.llmapi.llm_args": args,
            "tensorrt_llm._torch": torch_pkg, "tensorrt_llm._torch.utils": utils}


def install(monkeypatch, snapshot_name: str) -> types.ModuleType:
    """Put the fake package in sys.modules for one test; returns the top module."""
    mods = build(snapshot_name)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["tensorrt_llm"]
