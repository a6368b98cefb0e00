"""A conformance fake of `tensorrt_llm`, built from one API snapshot (tests/assets/trtllm/*.json).

FAKE, because tensorrt_llm cannot run here (no CUDA; its wheel comes from NVIDIA's index). It is
as strict as what the snapshot records of the real source (each field's path and commit are in
the snapshot's "fields"). By concern:
  trtllm_fake_sampling.py  SamplingParams: exactly the snapshot's init fields (an unknown keyword is
                           Python's own TypeError) and _validate's rules (ranges, best_of >= n,
                           greedy n>1, truncate_prompt_tokens, the log-prob rules); the seed as
                           each version uses it (ignored before PR #17172, per request after);
                           CompletionOutput with the snapshot's fields (routed_experts where
                           PR #18397 is in); TorchSampler's step and log-probs.
  trtllm_fake_llm.py       LLM: a keyword TorchLlmArgs lacks refused as _TorchLLM does (llm.py at
                           1f064c46), then the pydantic model built; Ray attached or
                           started as RayExecutor does it, and ray.shutdown() on LLM.shutdown();
                           workers placed as executor/ray/gpu_worker.py places them, with the
                           leader's environment; the worker extension imported from PYTHONPATH;
                           sleep by memory tag (NONE: garbage on wake-up, MEMSET: zeros, any other
                           or unlisted mode: content kept through a host copy); KV block reuse
                           that survives a sleep; stop on end_id with TorchSampler's greedy path;
                           _check_arguments' routed-experts pairing.
  trtllm_fake_ray.py       the ray calls the executor makes in the leader's process.
  this file                snapshots, the node's GPUs, the config classes (pydantic models,
                           extra="forbid"), SleepConfig's checks, the 1.4 line's LLM.release /
                           resume (MEMORY_API), and the modules put in sys.modules.
Generation is real: a transformers model, step by step in fp32, so tokens and log-probs are exact.
A byte ledger follows what would be resident on the GPU (weights, KV cache, other tags, a bucket).
"""
from __future__ import annotations

import enum
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, create_model, model_validator

from tests.rollout.trtllm_fake_llm import EXTRA_BYTES, KV, KV_BYTES, MODEL, WEIGHTS, FakeCluster, _LLM
from tests.rollout.trtllm_fake_ipc import reduce_cuda_like
from tests.rollout.trtllm_fake_ray import make_ray
from tests.rollout.trtllm_fake_sampling import completion_class, sampling_params_class

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "trtllm"
SNAPSHOTS = sorted(p.name for p in ASSETS.glob("trtllm-*.json"))
__all__ = ["EXTRA_BYTES", "KV", "KV_BYTES", "MEMORY_API", "MODEL", "WEIGHTS", "FakeCluster", "SNAPSHOTS", "build",
           "install", "load_snapshot", "sys"]


def load_snapshot(name: str) -> dict:
    return json.loads((ASSETS / name).read_text())


def visible_uuid(index: int) -> str:
    """The UUID of device `index` as this process numbers it (through its CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return FakeCluster.gpus[index]
    entry = visible.split(",")[index]
    return entry if entry.startswith("GPU-") else FakeCluster.gpus[int(entry)]


def _strict_model(name: str, fields: list[str], check=None):
    """A pydantic model as TensorRT-LLM's StrictBaseModel subclasses are (llmapi/utils.py;
    BaseLlmArgs and KvCacheConfig at 1f064c46): extra="forbid", so an unknown keyword is pydantic's
    own ValidationError ("Extra inputs are not permitted"). Every field is optional and untyped here;
    `check` stands in for the class's validators, run on the keywords before the fields are set."""
    config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())
    validators = {}
    if check is not None:
        def before(cls, data):
            check(dict(data) if isinstance(data, dict) else {})
            return data
        validators["check"] = model_validator(mode="before")(classmethod(before))
    return create_model(name, __config__=config, __validators__=validators,
                        **{f: (Any, None) for f in fields})


def _placement_check(kw):
    """RayPlacementConfig.validate_ray_placement (llm_args.py, index id 7019226376, messages as
    there). The PlacementGroup test is by class name: the fake's ray module is not Ray's."""
    pgs, indices, share = kw.get("placement_groups"), kw.get("placement_bundle_indices"), kw.get("per_worker_gpu_share")
    if (pgs is None) != (indices is None):
        raise ValueError("placement_groups and placement_bundle_indices must be provided together")
    if pgs is not None:
        if len(pgs) != len(indices):
            raise ValueError(f"placement_groups length ({len(pgs)}) must equal placement_bundle_indices length "
                             f"({len(indices)})")
        for i, pg in enumerate(pgs):
            if type(pg).__name__ != "PlacementGroup":
                raise TypeError(f"placement_groups[{i}] must be a Ray PlacementGroup, got {type(pg).__name__}")
    if share is not None and not 0 < share <= 1.0:
        raise ValueError(f"per_worker_gpu_share must be between 0 and 1.0, got {share}")


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


# TensorRT-LLM main (rlhf_utils.py, index excerpt, no commit): the reload cycle's abort.
ABORTABLE = {"reload_cycle": "abortable",
             "worker_methods": ["update_weights", "report_device_id", "sleep", "wakeup", "reset_prefix_cache",
                                "abort_update_weights", "wait_for_engine_idle"]}


# The 1.4 line: the LLM's public memory API, and the workers' wait_for_engine_idle.
MEMORY_API = {"llm_memory_api": True,
              "worker_methods": ["update_weights", "report_device_id", "sleep", "wakeup", "reset_prefix_cache",
                                 "wait_for_engine_idle"]}


class _MemoryAPI:
    """LLM.release / resume / get_memory_status. "Both synchronous LLM and asynchronous AsyncLLM
    expose release(), resume(), and get_memory_status() ... With no tags, release() selects every
    usable ExecutorMemoryType and resume() reactivates every tag still parked" (Runtime Memory
    Checkpointing page, current docs, no version); AsyncLLM.release(tags) is collective_rpc("sleep",
    (tags,)) (async_llm.py, the 1.4.0rc1 docs' module source). The sync LLM's own source was not read:
    its keyword is taken to be AsyncLLM's `tags`, as verl (release(tags=...)) and NeMo-RL
    (release(tags), positional) call it."""

    def release(self, tags=None):
        self.rpcs.append(("LLM.release", tags))
        usable = [t for t in self.snap["executor_memory_types"] if not t.startswith("_")]
        return self._sleep([getattr(t, "value", t) for t in usable if t not in self.released]
                           if tags is None else [getattr(t, "value", t) for t in tags])

    def resume(self, tags=None):
        self.rpcs.append(("LLM.resume", tags))
        return self._wakeup(sorted(self.released) if tags is None else [getattr(t, "value", t) for t in tags])

    def get_memory_status(self):
        """RuntimeMemoryStatus(state, parked_tags) (1.4.0rc4 reference index), as a plain namespace."""
        return types.SimpleNamespace(state="parked" if self.released else "running", parked_tags=sorted(self.released))


def _worker_extension(snap: dict) -> type:
    """rlhf_utils.WorkerExtension: its methods as the snapshot lists them (the workers run them)."""
    return type("WorkerExtension", (), {m: (lambda self, *a: None) for m in snap.get("worker_methods") or []})


def build(snapshot_name: str, overrides: dict | None = None) -> dict[str, types.ModuleType]:
    """The fake package's modules for one snapshot (with `overrides` of its keys), and a fake ray:
    {module name: module} for sys.modules."""
    snap = {**load_snapshot(snapshot_name), **(overrides or {})}
    root = types.ModuleType("tensorrt_llm")
    root.__version__ = snap["version"]
    root.__path__ = []
    root.__file__ = str(ASSETS / "site-packages" / "tensorrt_llm" / "__init__.py")   # its bin/ is beside it
    bases = (_MemoryAPI, _LLM) if snap.get("llm_memory_api") else (_LLM,)
    root.LLM = type("LLM", bases, {"snap": snap, "mod": root, "instances": []})
    root.SamplingParams = sampling_params_class(snap)
    root.CompletionOutput = completion_class(snap)
    args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    args.TorchLlmArgs = _strict_model("TorchLlmArgs", snap["llm_args_fields"])
    args.KvCacheConfig = _strict_model("KvCacheConfig", snap["kv_cache_config_fields"])
    mods = {}
    if "cuda_graph_config" in snap["llm_args_fields"]:
        # llm_args.py: BaseCudaGraphConfig's fields at 00043967 (main), what verl passes
        args.CudaGraphConfig = _strict_model("CudaGraphConfig", ["batch_sizes", "max_batch_size", "enable_padding"])
    if "scheduler_config" in snap["llm_args_fields"]:
        # llm_args.py SchedulerConfig and its policy (index excerpts, no commit; the two members read)
        args.CapacitySchedulerPolicy = enum.Enum("CapacitySchedulerPolicy", {
            "MAX_UTILIZATION": "MAX_UTILIZATION", "GUARANTEED_NO_EVICT": "GUARANTEED_NO_EVICT"}, type=str)
        args.SchedulerConfig = _strict_model("SchedulerConfig", ["capacity_scheduler_policy", "context_chunking_policy",
                                                                 "dynamic_batch_config"])
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
        args.RayPlacementConfig = _strict_model("RayPlacementConfig", snap["ray_placement_config_fields"],
                                                _placement_check)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.__path__ = []
    llmapi.llm_args = args
    llmapi.KvCacheConfig = args.KvCacheConfig
    llmapi.SamplingParams = root.SamplingParams
    root.llmapi = llmapi
    if snap.get("sampling_module") == "executor.params.sampling":
        # Where SamplingParams and LogprobMode live on main (executor/params/sampling.py at 1f064c46).
        sampling_mod = types.ModuleType("tensorrt_llm.executor.params.sampling")
        sampling_mod.SamplingParams = root.SamplingParams
        sampling_mod.LogprobMode = enum.Enum("LogprobMode", {"RAW": "raw", "PROCESSED": "processed"}, type=str)
        for name in ("tensorrt_llm.executor", "tensorrt_llm.executor.params"):
            mods[name] = types.ModuleType(name)
            mods[name].__path__ = []
        mods["tensorrt_llm.executor.params.sampling"] = sampling_mod
    rlhf = types.ModuleType("tensorrt_llm.llmapi.rlhf_utils")
    rlhf.WorkerExtension = _worker_extension(snap)
    llmapi.rlhf_utils = rlhf
    mods["tensorrt_llm.llmapi.rlhf_utils"] = rlhf
    utils = types.ModuleType("tensorrt_llm._torch.utils")
    utils.get_device_uuid = visible_uuid
    torch_pkg = types.ModuleType("tensorrt_llm._torch")
    torch_pkg.__path__ = []
    torch_pkg.utils = utils
    return {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi, "tensorrt_llm.llmapi.llm_args": args,
            "tensorrt_llm._torch": torch_pkg, "tensorrt_llm._torch.utils": utils, **make_ray().modules, **mods}


def install(monkeypatch, snapshot_name: str, overrides: dict | None = None, real_ray: bool = False
            ) -> types.ModuleType:
    """Put the fake package (and a fake ray, unless `real_ray`) in sys.modules for one test;
    returns the top module."""
    mods = build(snapshot_name, overrides)
    if real_ray:
        mods = {k: v for k, v in mods.items() if k != "ray" and not k.startswith("ray.")}
    # torch's reduce_tensor of a CUDA tensor, which this CPU cannot make (trtllm_fake_ipc.py)
    from megarl.rollout.trtllm import comm
    monkeypatch.setattr(comm, "reduce_tensor", reduce_cuda_like)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["tensorrt_llm"]


def install_in_process(snapshot_name: str) -> types.ModuleType:
    """`install` for a spawned rank's process, which ends with the test: no undo needed."""
    from megarl.rollout.trtllm import comm
    mods = build(snapshot_name)
    sys.modules.update(mods)
    comm.reduce_tensor = reduce_cuda_like
    return mods["tensorrt_llm"]
