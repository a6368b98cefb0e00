"""A conformance fake of `tensorrt_llm`, built from one API snapshot (tests/assets/trtllm/*.json).

FAKE, because tensorrt_llm cannot run here (no CUDA; its wheel comes from NVIDIA's index). It is
as strict as what the snapshot records of the real source (each field's path and commit are in
the snapshot's "fields"):
  - SamplingParams is a dataclass of exactly the snapshot's init fields (an unknown keyword is
    Python's own TypeError) whose _validate applies the snapshot's rules: ranges, best_of >= n,
    greedy n>1, truncate_prompt_tokens, the log-prob rules (True->0 / False->None, the limit,
    the simple format only with logprobs == 0 and without beam search, logprobs_mode raw by default);
  - LLM / KvCacheConfig / SleepConfig reject unknown arguments as TensorRT-LLM's pydantic models do;
    SleepConfig's restore modes must be the enum's tags and the snapshot's modes;
  - workers are placed as the Ray executor places them (executor/ray/executor.py,
    gpu_worker.py): a local Ray instance sees the GPUs CUDA_VISIBLE_DEVICES names when the LLM
    starts, the workers inherit the leader's environment, and each parses its Ray GPU id with
    int() and maps it through CUDA_VISIBLE_DEVICES parsed as integers (UUIDs raise ValueError);
    the worker extension must import from the workers' PYTHONPATH (nothing is installed there);
  - sleep releases memory by tag; on wake-up a tag with restore mode NONE comes back as garbage
    (NaN), MEMSET as zeros, any other mode with its content. Where the snapshot has a
    `model_weights` tag the parameters live there and the model's other buffers (the rotary
    inv_freq) under `model`; without it both live under `model`.
Generation is real: a transformers model, step by step in fp32, so tokens and log-probs are exact.
A byte ledger follows what would be resident on the GPU (weights, KV cache, a bucket in flight).
"""
from __future__ import annotations

import base64
import copy
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
KV, MODEL, WEIGHTS = "kv_cache", "model", "model_weights"


def load_snapshot(name: str) -> dict:
    return json.loads((ASSETS / name).read_text())


class FakeCluster:
    """The node: its GPUs in CUDA's own order (a process without CUDA_VISIBLE_DEVICES sees them all),
    and which packages are installed in the Ray workers' Python (none: megarl is not pip-installed)."""
    gpus: list[str] = [f"GPU-fake-{i}" for i in range(8)]
    installed: set[str] = set()


def visible_uuid(index: int) -> str:
    """The UUID of device `index` as this process numbers it (through its CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return FakeCluster.gpus[index]
    entry = visible.split(",")[index]
    return entry if entry.startswith("GPU-") else FakeCluster.gpus[int(entry)]


def _strict_model(name: str, fields: list[str], check=None):
    """A pydantic-like config class: keyword arguments, unknown ones rejected."""
    allowed = frozenset(fields)

    def __init__(self, **kw):
        extra = sorted(set(kw) - allowed)
        if extra:
            raise ValueError(f"1 validation error for {name}\n{extra[0]}\n  Extra inputs are not permitted")
        if check is not None:
            check(kw)
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


def _coerce_logprobs(value, rules: dict):
    """1.2: `logprobs and int(logprobs)` (True->1, False stays False); 1.3: True->0, False->None."""
    if value is True:
        return rules["logprobs_true_is"]
    if value is False:
        return rules["logprobs_false_is"]
    return value and int(value) if rules["logprobs_true_is"] == 1 else (None if value is None else int(value))


def _validate_logprobs(sp, rules: dict, modes) -> None:
    sp.logprobs = _coerce_logprobs(sp.logprobs, rules)
    sp.prompt_logprobs = _coerce_logprobs(sp.prompt_logprobs, rules)
    limit = rules.get("logprobs_max")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if limit is not None and value is not None and not 0 <= value <= limit:
            raise ValueError(f"{name} must be between 0 and {limit}, got {name}={value}")
    if rules.get("simple_format_needs_logprobs") is not None:
        for flag, name in (("logprobs_simple_format", "logprobs"),
                           ("prompt_logprobs_simple_format", "prompt_logprobs")):
            if getattr(sp, flag) and getattr(sp, name) != 0:
                raise ValueError(f"{flag}=True requires {name} == 0 (the sampled token only), "
                                 f"got {name}={getattr(sp, name)}")
        if rules.get("simple_format_no_beam_search") and sp.logprobs_simple_format and sp.use_beam_search:
            raise ValueError("logprobs_simple_format=True is not supported with beam search")
    if modes is not None:
        if sp.logprobs_mode is None:
            sp.logprobs_mode = rules["logprobs_mode_default"]
        if str(getattr(sp.logprobs_mode, "value", sp.logprobs_mode)) not in modes:
            raise ValueError(f"logprobs_mode must be one of {modes}, got {sp.logprobs_mode!r}")


def _sampling_params_class(snap: dict):
    modes, rules = snap.get("logprobs_modes"), snap["sampling_rules"]

    def __post_init__(self):
        self.best_of = self.best_of or self.n
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy = not self.use_beam_search and (
            (self.temperature is None and self.top_p is None and self.top_k is None)
            or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0)
        if self.best_of > 1 and greedy and not os.environ.get(snap.get("greedy_n_env", "TLLM_ALLOW_N_GREEDY_DECODING")):
            raise ValueError(f"Greedy decoding in the LLM API does not allow multiple returns. Please set to "
                             f"best_of=1, got best_of={self.best_of}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        _validate_logprobs(self, rules, modes)

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
        type(self).instances.append(self)
        self.shut = False
        extra = sorted(set(kwargs) - set(self.snap["llm_args_fields"]))
        if extra:
            raise ValueError(f"1 validation error for TorchLlmArgs\n{extra[0]}\n  Extra inputs are not permitted")
        self.kwargs = kwargs
        self.tp = kwargs.get("tensor_parallel_size", 1)
        self.sleep_modes = self._restore_modes(kwargs)
        self.workers = self._start_workers(kwargs.get("ray_worker_extension_cls"))
        from transformers import AutoConfig, AutoModelForCausalLM
        path = kwargs["model"]
        if kwargs.get("load_format", "auto") == "dummy":
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.model.float()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.weight_tag = WEIGHTS if WEIGHTS in (self.snap.get("executor_memory_types") or []) else MODEL
        self.released: set[str] = set()
        self.events: list = []
        self.resident = self.weight_bytes + KV_BYTES
        self.peak = self.resident
        self.rpcs: list = []
        self.sent: list = []                  # every SamplingParams generate() received
        self.prefix_cache: list = []          # (prompt, its KV) that block reuse may serve again

    # -- start-up, as the Ray executor does it ---------------------------------------------------
    def _start_workers(self, extension: str | None) -> list[str]:
        """Ray started here sees the GPUs CUDA_VISIBLE_DEVICES names (all of them without it); worker
        r takes Ray GPU slot r; RayWorkerWrapper does int(ray.get_gpu_ids()[0]) (Ray returns the
        entry of the worker's inherited CUDA_VISIBLE_DEVICES) and maps it back through that list
        parsed as integers; the worker then runs on that physical GPU."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = visible.split(",") if visible else [str(i) for i in range(len(FakeCluster.gpus))]
        if len(entries) < self.tp:
            raise RuntimeError(f"the placement group needs {self.tp} GPU(s), Ray sees {len(entries)}")
        workers = []
        for slot in range(self.tp):
            gpu = int(entries[slot])                                  # ValueError on a UUID, as the real one
            if visible:
                local = list(map(int, visible.split(","))).index(gpu)  # physical_to_local_id
                gpu = int(visible.split(",")[local])
            workers.append(FakeCluster.gpus[gpu])
            if extension:
                self._import_extension(extension)
        return workers

    @staticmethod
    def _import_extension(qualname: str) -> None:
        top = qualname.split(".")[0]
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if top not in FakeCluster.installed and not any(os.path.isdir(os.path.join(p, top)) for p in paths):
            raise RuntimeError("RayGPUWorker died during initialization") from RuntimeError(
                f"Failed to load worker extension '{qualname}'")

    def _restore_modes(self, kwargs) -> dict | None:
        if kwargs.get("sleep_config") is not None:
            return {(m.value if isinstance(m, enum.Enum) else m): v
                    for m, v in kwargs["sleep_config"].restore_modes.items()}
        if kwargs.get("enable_sleep"):
            return {}
        return None

    # -- the ledger ----------------------------------------------------------------------------
    def _account(self, delta: int, what: str) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)
        self.events.append((what, self.resident))

    def _bytes(self, tag: str) -> int:
        return {KV: KV_BYTES, self.weight_tag: self.weight_bytes}.get(tag, 0)

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
        if method == "reset_prefix_cache" and method in (self.snap.get("worker_methods") or []):
            self.prefix_cache = []
            return [None] * len(self.workers)
        raise AttributeError(f"the workers have no method {method!r}")

    def _update_weights(self, handles):
        if self.weight_tag in self.released:
            raise RuntimeError("CUDA error: an illegal memory access (weights released, not resumed)")
        if handles is None:
            self.prefix_cache = []            # the finalize call resets the prefix cache (rlhf_utils.py)
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

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == self.weight_tag and tag != MODEL:
            return list(self.model.parameters())
        if tag == MODEL:
            return list(self.model.buffers()) + (list(self.model.parameters()) if self.weight_tag == MODEL else [])
        return []

    def _sleep(self, tags):
        if self.sleep_modes is None:
            raise ValueError("Sleep feature is not enabled, please set sleep_config in the LLM arguments.")
        valid = set(self.snap["executor_memory_types"] or [])
        for tag in tags:
            if tag not in valid:
                raise ValueError(f"'{tag}' is not a valid ExecutorMemoryType")
        for tag in tags:
            if tag in self.released:
                continue
            self.released.add(tag)
            self._account(-self._bytes(tag), f"release {tag}")
            if self.sleep_modes.get(tag) not in ("NONE", "MEMSET") and self._bytes(tag):
                self.events.append((f"host copy {tag}", self._bytes(tag)))
        return [None] * len(self.workers)

    def _wakeup(self, tags):
        for tag in tags:
            if tag not in self.released:
                continue
            self.released.discard(tag)
            self._account(self._bytes(tag), f"resume {tag}")
            mode = self.sleep_modes.get(tag)
            if tag == KV and mode == "NONE":
                self._garble_prefix_cache()   # the reuse tree survives; the blocks' memory does not
            with torch.no_grad():
                for t in self._tensors(tag):
                    if mode == "NONE":       # no backup: whatever the memory holds
                        t.fill_(float("nan"))
                    elif mode == "MEMSET":
                        t.zero_()
            if mode not in ("NONE", "MEMSET") and self._bytes(tag):
                self.events.append((f"host copy {tag}", self._bytes(tag)))
        return [None] * len(self.workers)

    def shutdown(self):
        self.shut = True

    # -- generation ------------------------------------------------------------------------------
    def generate(self, inputs, sampling_params=None):
        blocked = {MODEL, self.weight_tag, KV} & self.released
        if blocked:
            raise RuntimeError(f"generate() while {sorted(blocked)} are released")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError("one SamplingParams per prompt")
        self.sent.extend(params)
        return [self._one(list(p), sp) for p, sp in zip(inputs, params)]

    BLOCK = 32                                # KvCacheConfig.tokens_per_block's default

    def _prefill(self, prompt):
        """KV block reuse (KvCacheConfig.enable_block_reuse, on by default): whole blocks of a
        prompt prefix that an earlier request computed are served from that request's KV, whatever
        the weights were then. Only a reset forgets them: update_weights(None) (rlhf_utils.py
        calls engine.reset_prefix_cache() there, 65b31db / 04762f3b) or the extension's
        reset_prefix_cache. A bucket (update_weights(handles)) and a sleep do not: after a sleep
        that released kv_cache with restore mode NONE the reused blocks hold garbage (NaN here)."""
        reuse = getattr(self.kwargs.get("kv_cache_config"), "enable_block_reuse", True) is not False
        best, source = 0, None
        for seq, kv in self.prefix_cache if reuse else []:
            same = next((i for i, (a, b) in enumerate(zip(seq, prompt)) if a != b), min(len(seq), len(prompt)))
            usable = min(same, len(prompt) - 1) // self.BLOCK * self.BLOCK   # the last token is always computed
            if usable > best:
                best, source = usable, kv
        if source is None:
            out = self.model(torch.tensor([prompt]), use_cache=True)
        else:
            past = copy.deepcopy(source)
            if best < past.get_seq_length():
                past.crop(best - past.get_seq_length())   # this transformers crops by a negative count
            out = self.model(torch.tensor([prompt[best:]]), past_key_values=past, use_cache=True)
        if reuse:
            self.prefix_cache.append((tuple(prompt), copy.deepcopy(out.past_key_values)))
        return out

    def _garble_prefix_cache(self) -> None:
        for _, kv in self.prefix_cache:
            for layer in kv.layers:
                layer.keys.fill_(float("nan"))
                layer.values.fill_(float("nan"))

    @torch.no_grad()
    def _one(self, prompt, sp):
        max_len = self.kwargs.get("max_seq_len")
        if max_len is not None and len(prompt) + sp.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({sp.max_tokens}) > max_seq_len ({max_len})")
        outs = []
        for j in range(sp.best_of):
            gen = torch.Generator().manual_seed((sp.seed or 0) * 1000 + j)
            toks, entries, reason = [], [], "length"
            out = self._prefill(prompt)
            for _ in range(sp.max_tokens):
                if toks:
                    out = self.model(torch.tensor([toks[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                tok, raw, processed = self._step(out.logits[0, -1].float(), prompt + toks, sp, gen)
                toks.append(tok)
                entries.append(self._logprobs(tok, raw, processed, sp))
                if sp.stop_token_ids and tok in sp.stop_token_ids and self._checks_stop_words(sp):
                    reason = "stop"
                    break
                if sp.end_id not in (None, -1) and tok == sp.end_id:
                    reason = "stop"
                    break
            if reason == "stop" and not sp.include_stop_str_in_output:
                toks, entries = toks[:-1], entries[:-1]
            outs.append(self.mod.CompletionOutput(index=j, token_ids=toks, finish_reason=reason,
                                                  logprobs=entries if sp.logprobs is not None else []))
        return RequestOutput(prompt_token_ids=prompt, outputs=outs[:sp.n])

    def _checks_stop_words(self, sp) -> bool:
        """TorchSampler (the 1.3 default: sampler_type "auto" picks it unless beam search,
        llmapi/llm_args.py) stops greedy requests only on `py_end_id`: its fast greedy path
        (_can_use_fast_greedy_path, _torch/pyexecutor/sampler.py) never looks at stop words. The real
        one takes that path only when no request of the batch asks for log-probs; the fake applies
        it to every greedy request, which is stricter (verl's trtllm rollout notes that both
        samplers stop only on end_id and sends end_id=-1 only with TRTLLMSampler)."""
        torch_sampler = self.kwargs.get("sampler_type", "auto") in ("auto", "TorchSampler") and not sp.use_beam_search
        greedy = sp.temperature in (None, 0) or sp.top_k == 1 or sp.top_p == 0.0
        return not (torch_sampler and greedy)

    @staticmethod
    def _step(logits, seen, sp, gen):
        raw = torch.log_softmax(logits, -1)
        proc = logits.clone()
        if sp.repetition_penalty not in (None, 1.0):
            ids = torch.tensor(sorted(set(seen)))
            vals = proc[ids]
            proc[ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if sp.temperature in (None, 0) or sp.top_k == 1:
            return int(proc.argmax()), raw, torch.log_softmax(proc, -1)
        proc = proc / sp.temperature
        if sp.top_k:
            kth = proc.topk(sp.top_k).values[-1]
            proc[proc < kth] = float("-inf")
        if sp.top_p is not None and sp.top_p < 1:
            order = proc.argsort(descending=True)
            probs = torch.softmax(proc[order], -1)
            proc[order[(probs.cumsum(-1) - probs) > sp.top_p]] = float("-inf")
        processed = torch.log_softmax(proc, -1)
        return int(torch.multinomial(processed.exp(), 1, generator=gen)), raw, processed

    def _logprobs(self, tok, raw, processed, sp):
        if sp.logprobs is None or sp.logprobs is False:
            return None
        if self.snap.get("logprobs_modes") is None:
            # 1.2: the top-K only; the sampled token is there only when it ranks in the top K.
            top = raw.topk(sp.logprobs)
            return {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}
        values = processed if str(getattr(sp.logprobs_mode, "value", sp.logprobs_mode)) == "processed" else raw
        if sp.logprobs_simple_format:
            return float(values[tok])
        out = {tok: Logprob(float(values[tok]), int((values > values[tok]).sum()) + 1)}
        if sp.logprobs:                       # 1.3: the sampled token plus the top K
            top = values.topk(sp.logprobs)
            for r, (v, t) in enumerate(zip(top.values, top.indices)):
                out.setdefault(int(t), Logprob(float(v), r + 1))
        return out


def _sleep_config_check(snap: dict, mem_enum):
    def check(kw):
        modes = kw.get("restore_modes") or {}
        allowed = snap.get("restore_modes") or []
        for tag, mode in modes.items():
            mem_enum(tag.value if isinstance(tag, enum.Enum) else tag)      # ValueError on an unknown tag
            if str(mode) not in allowed:
                raise ValueError(f"1 validation error for SleepConfig\nrestore_modes\n  Input should be one of "
                                 f"{allowed}, got {mode!r}")
    return check


def build(snapshot_name: str) -> dict[str, types.ModuleType]:
    """The fake package's modules for one snapshot: {module name: module} for sys.modules."""
    snap = load_snapshot(snapshot_name)
    root = types.ModuleType("tensorrt_llm")
    root.__version__ = snap["version"]
    root.__path__ = []
    root.LLM = type("LLM", (_LLM,), {"snap": snap, "mod": root, "instances": []})
    root.SamplingParams = _sampling_params_class(snap)
    root.CompletionOutput = _completion_class(snap)
    args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    args.TorchLlmArgs = _strict_model("TorchLlmArgs", snap["llm_args_fields"])
    args.KvCacheConfig = _strict_model("KvCacheConfig", snap["kv_cache_config_fields"])
    mods = {}
    if snap.get("executor_memory_types"):
        mem = enum.Enum("ExecutorMemoryType", {t.strip("_").upper(): t for t in snap["executor_memory_types"]},
                        type=str)
        vm = types.ModuleType("tensorrt_llm._torch.virtual_memory")   # where the enum is defined
        vm.ExecutorMemoryType = mem
        args.ExecutorMemoryType = mem                                # and where newer commits import it
        mods["tensorrt_llm._torch.virtual_memory"] = vm
        if snap.get("sleep_config_fields"):
            args.SleepConfig = _strict_model("SleepConfig", snap["sleep_config_fields"], _sleep_config_check(snap, mem))
    if snap.get("ray_placement_config_fields"):
        args.RayPlacementConfig = _strict_model("RayPlacementConfig", snap["ray_placement_config_fields"])
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.__path__ = []
    llmapi.llm_args = args
    llmapi.KvCacheConfig = args.KvCacheConfig
    llmapi.SamplingParams = root.SamplingParams
    root.llmapi = llmapi
    utils = types.ModuleType("tensorrt_llm._torch.utils")
    utils.get_device_uuid = visible_uuid
    torch_pkg = types.ModuleType("tensorrt_llm._torch")
    torch_pkg.__path__ = []
    torch_pkg.utils = utils
    return {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm.llmapi.llm_args": args,
            "tensorrt_llm._torch": torch_pkg, "tensorrt_llm._torch.utils": utils, **mods}


def install(monkeypatch, snapshot_name: str) -> types.ModuleType:
    """Put the fake package in sys.modules for one test; returns the top module."""
    mods = build(snapshot_name)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["tensorrt_llm"]
