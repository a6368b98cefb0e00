"""What megarl asks of TensorRT-LLM: feature detection, the LLM's and SamplingParams' arguments,
the sleep plan, and reading log-probs back. Pure functions of the rollout config and the detected
features (tested on CPU against the snapshots in tests/assets/trtllm/).

Versions, by feature detection (never by version string; `detect_features`):
  SamplingParams.logprobs_mode         (1.3+, PR #9675) raw / processed log-probs. Without it
                                       (1.2.x) the log-probs are top-K dicts that may omit the
                                       sampled token: 1.2 is refused for rollouts.
  SamplingParams.logprobs_simple_format one float per token. `_validate` accepts it only with
                                       logprobs == 0, which means "the sampled token only".
  LLM arg sleep_config / enable_sleep  1.3+ SleepConfig(restore_modes) / 1.2's switch
  ExecutorMemoryType.model_weights     the weights under a tag of their own: only they (and the
                                       KV cache) may come back without their content.
  LLM(enable_return_routed_experts),   routing replay (R3): all three or R3 is refused. LLM.
  SamplingParams.return_routed_experts _check_arguments refuses the request flag without the LLM's
  CompletionOutput.routed_experts      (1.3.0rc28 docs, module source); rc29's reference pages list
                                       all three (PR #18397).
  Per-request seeds (PR #17172) change TorchSampler's internals, not a class megarl can read:
  megarl gives every prompt its own seed anyway (`llm_api.prompt_seed`); a build before the PR ignores it.

Log-probs: the trainer scores log_softmax(logits / T) of the sampled token, before top-k/top-p
and penalties (greedy: T=1). TensorRT-LLM reports "raw" (before temperature) or "processed"
(after temperature, penalties and top-k/top-p). raw is exact when T=1 (or greedy); processed
when only temperature applies. Any other mix has no exact source and is refused with the fix.

Sleep (only with enable_sleep_mode=True): sleep() releases every memory tag the build has (the
`_no_capture_*` start-up tags aside). SleepConfig.restore_modes names NONE (released, nothing
copied, garbage on wake-up) only for what nothing needs back: `kv_cache`, and `model_weights`
when the weights come from syncs (load_format=dummy; the next full sync rewrites them). Every
other tag (`model`, `model_extra`, `executor_extra`, `sampler`, CUDA-graph pools, the weights
with load_format=auto, ...) is left out of restore_modes: TensorRT-LLM's SleepConfig then backs
it up in host memory ("Unlisted entries default to the suitable mode selected between PINNED and
CPU", SleepConfig reference page) and restores its content on wake-up, so it leaves the GPU
without being lost. A build without a `model_weights` tag backs the weights up with the rest:
its `model` tag holds other buffers too, and discarding those would corrupt the model silently
(TensorRT-LLM's own discard test and verl's rollout set NONE on MODEL_WEIGHTS_MAIN and KV_CACHE
only).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from megarl.config.errors import ConfigError
from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.config import RolloutConfig
# The rules TensorRT-LLM shares with vLLM (log-prob mode, budget, completions): megarl/rollout/llm_api.py
from megarl.rollout.llm_api import completion_from_output as shared_completion
from megarl.rollout.llm_api import logprob_mode, prompt_seed, response_budget  # noqa: F401
from megarl.rollout.trtllm.resources import graph_and_scheduler

KEY = "actor_rollout_ref.rollout"
KV_TAG = "kv_cache"
WEIGHTS_TAG = "model_weights"
LOGPROBS_NEEDED = "TensorRT-LLM >= 1.3 (SamplingParams.logprobs_mode, PR #9675)"


def require_tensorrt_llm():
    try:
        import tensorrt_llm  # optional dependency (megarl[trtllm])
    except Exception as err:  # ImportError, or a CUDA/driver error raised while importing
        raise ImportError(
            f"rollout.name=trtllm needs the tensorrt_llm package ({LOGPROBS_NEEDED}), which does not import "
            f"here ({type(err).__name__}: {err}). Install it on a CUDA machine from NVIDIA's index "
            "(pip install 'megarl[trtllm]' --extra-index-url https://pypi.nvidia.com), or use rollout.name=native"
        ) from err
    return tensorrt_llm


def sampling_classes(tllm) -> tuple[Any, Any]:
    """(SamplingParams, LogprobMode or None) from where they live: tensorrt_llm/executor/params/
    sampling.py on main (1f064c46), tensorrt_llm/sampling_params.py before the move."""
    for name in ("tensorrt_llm.executor.params.sampling", "tensorrt_llm.sampling_params"):
        try:
            mod = importlib.import_module(name)     # optional dependency (megarl[trtllm])
        except ImportError:
            continue
        if hasattr(mod, "SamplingParams"):
            return mod.SamplingParams, getattr(mod, "LogprobMode", None)
    return tllm.SamplingParams, None


# -- feature detection ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Features:
    version: str
    sampling_fields: frozenset[str]        # SamplingParams' init fields
    llm_fields: frozenset[str]             # what LLM(...) accepts: its args model's fields + named params
    memory_tags: tuple[str, ...]           # ExecutorMemoryType values (the "_no_capture" ones left out)
    completion_fields: frozenset[str] = frozenset()   # CompletionOutput's fields
    worker_methods: frozenset[str] = frozenset()      # rlhf_utils.WorkerExtension's public methods
    llm_methods: frozenset[str] = frozenset()         # LLM's public memory methods (release, resume)

    @property
    def memory_api(self) -> bool:
        """LLM.release(tags) / resume(tags) (the 1.4 line; the Runtime Memory Checkpointing docs)."""
        return {"release", "resume"} <= self.llm_methods

    @property
    def waits_for_idle(self) -> bool:
        """WorkerExtension.wait_for_engine_idle (TensorRT-LLM PR #13784): returns once no request
        is queued or running in the executor."""
        return "wait_for_engine_idle" in self.worker_methods

    @property
    def aborts_reload(self) -> bool:
        """rlhf_utils.WorkerExtension.abort_update_weights (main): ends a torn reload cycle."""
        return "abort_update_weights" in self.worker_methods

    @property
    def logprobs_mode(self) -> bool:
        return "logprobs_mode" in self.sampling_fields

    @property
    def simple_format(self) -> bool:
        return "logprobs_simple_format" in self.sampling_fields

    @property
    def sleep(self) -> str | None:
        return "sleep_config" if "sleep_config" in self.llm_fields else (
            "enable_sleep" if "enable_sleep" in self.llm_fields else None)

    def routes_missing(self) -> list[str]:
        """What routing replay needs and this build lacks (empty: R3 works)."""
        need = [("LLM(enable_return_routed_experts)", "enable_return_routed_experts" in self.llm_fields),
                ("SamplingParams.return_routed_experts", "return_routed_experts" in self.sampling_fields),
                ("CompletionOutput.routed_experts", "routed_experts" in self.completion_fields)]
        return [name for name, present in need if not present]

    def summary(self) -> str:
        return (f"TensorRT-LLM {self.version}: logprobs_mode={self.logprobs_mode} "
                f"logprobs_simple_format={self.simple_format} sleep={self.sleep or 'none'} "
                f"weights_tag={WEIGHTS_TAG in self.memory_tags} routed_experts={not self.routes_missing()} "
                f"abort_update_weights={self.aborts_reload} release_resume={self.memory_api} "
                f"wait_for_engine_idle={self.waits_for_idle}")


def _init_params(fn) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def memory_type_enum(args_mod):
    """ExecutorMemoryType: defined in tensorrt_llm/_torch/virtual_memory.py, imported by
    llmapi/llm_args.py on newer commits; None where neither has it (1.2.0rc2)."""
    mem = getattr(args_mod, "ExecutorMemoryType", None)
    if mem is None:
        try:
            from tensorrt_llm._torch.virtual_memory import ExecutorMemoryType as mem  # optional (megarl[trtllm])
        except ImportError:
            return None
    return mem


def detect_features(tllm) -> Features:
    """What this tensorrt_llm accepts, read from its classes (dataclass fields, pydantic model fields,
    the LLM constructor's named parameters), not from its version string."""
    sampling = frozenset(f.name for f in dataclasses.fields(sampling_classes(tllm)[0]) if f.init)
    from tensorrt_llm.llmapi import llm_args as args_mod  # optional dependency (megarl[trtllm])
    model = getattr(args_mod, "TorchLlmArgs", None) or getattr(args_mod, "LlmArgs")
    llm = frozenset(set(getattr(model, "model_fields", {})) | _init_params(tllm.LLM.__init__))
    mem = memory_type_enum(args_mod)
    tags = tuple(str(m.value) for m in mem if not str(m.value).startswith("_")) if mem is not None else ()
    output = getattr(tllm, "CompletionOutput", None) or getattr(tllm.llmapi, "CompletionOutput", None)
    completion = frozenset(f.name for f in dataclasses.fields(output)) if dataclasses.is_dataclass(output) else \
        frozenset(getattr(output, "__annotations__", {}))
    try:
        from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension  # optional dependency (megarl[trtllm])
        methods = frozenset(m for m in dir(WorkerExtension) if not m.startswith("_"))
    except ImportError:
        methods = frozenset()
    public = frozenset(m for m in ("release", "resume") if callable(getattr(tllm.LLM, m, None)))
    return Features(str(getattr(tllm, "__version__", "?")), sampling, llm, tags, completion, methods, public)


# -- engine arguments --------------------------------------------------------------------------------
def max_model_len(cfg: RolloutConfig) -> int | None:
    if cfg.max_model_len:
        return cfg.max_model_len
    if cfg.prompt_length and cfg.response_length:
        return cfg.prompt_length + cfg.response_length
    return None


def sleep_weights(cfg: RolloutConfig, feats: Features) -> str:
    """What sleep() does with the weights: "drop" (tag model_weights, restore mode NONE; the next
    full sync rewrites them) when they come from syncs (load_format=dummy) and the build has that
    tag, else "keep" (released with a host copy, restored on wake-up)."""
    return "drop" if cfg.load_format == "dummy" and WEIGHTS_TAG in feats.memory_tags else "keep"


def discarded_tags(weights: str) -> list[str]:
    """The tags whose content nothing needs after a sleep (restore mode NONE): the KV cache, and the
    weights when the next sync rewrites them."""
    return [KV_TAG] + ([WEIGHTS_TAG] if weights == "drop" else [])


def sleep_tags(feats: Features) -> list[str]:
    """Every tag sleep() releases: all the build has, the KV cache last (released tag by tag, the
    measured figures then end with the largest one)."""
    return sorted(feats.memory_tags, key=lambda t: t == KV_TAG)


def check_config(cfg: RolloutConfig, feats: Features) -> None:
    """Refusals that need no GPU: each one line with the fix, before anything starts."""
    missing = feats.routes_missing()
    if cfg.enable_rollout_routing_replay and missing:
        raise ConfigError(f"TensorRT-LLM {feats.version} has no {', '.join(missing)}, so it cannot return the experts "
                          "its router chose (R3 needs all three, NVIDIA/TensorRT-LLM PR #18397, in 1.3.0rc29's "
                          "classes): upgrade tensorrt_llm, or use rollout.name=native, or R2 "
                          "(actor_rollout_ref.actor.router_replay.mode=R2) with this key off",
                          f"{KEY}.enable_rollout_routing_replay")
    if not feats.logprobs_mode:
        raise ConfigError(f"TensorRT-LLM {feats.version} cannot return the sampled token's log-prob exactly (its top-K "
                          f"log-probs may omit the sampled token); rollouts need {LOGPROBS_NEEDED}: upgrade "
                          "tensorrt_llm or use rollout.name=native", f"{KEY}.name")
    if cfg.free_cache_engine and not cfg.enable_sleep_mode:
        raise ConfigError("free_cache_engine=true needs enable_sleep_mode=true with rollout.name=trtllm (TensorRT-LLM "
                          "frees its memory only with sleep support built in); set enable_sleep_mode=true or "
                          "free_cache_engine=false", f"{KEY}.free_cache_engine")
    if cfg.enable_sleep_mode and (feats.sleep != "sleep_config" or KV_TAG not in feats.memory_tags):
        # enable_sleep alone has no per-tag restore modes: megarl could not release the KV cache
        # without a host copy of everything else.
        raise ConfigError(f"TensorRT-LLM {feats.version} has no SleepConfig(restore_modes) with memory tags (sleep: "
                          f"{feats.sleep or 'none'}); megarl needs TensorRT-LLM >= 1.3 for sleep: upgrade, or set "
                          "enable_sleep_mode=false and free_cache_engine=false", f"{KEY}.enable_sleep_mode")
    logprob_mode(SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                repetition_penalty=cfg.repetition_penalty, do_sample=cfg.do_sample))


def sleep_config(tllm_args_mod, weights: str):
    """SleepConfig(restore_modes): NONE for exactly the tags nothing needs back (see the module
    docstring); no other tag is named, so each is backed up in host memory and keeps its content."""
    mem = memory_type_enum(tllm_args_mod)
    return tllm_args_mod.SleepConfig(restore_modes={mem(tag): "NONE" for tag in discarded_tags(weights)})


def llm_kwargs(cfg: RolloutConfig, model_dir: str, feats: Features, tllm_args_mod: Any,
               extension: str | None = None, kv_memory_fraction: float | None = None) -> dict[str, Any]:
    """Arguments of tensorrt_llm.LLM from the rollout config, only those this version has;
    `engine_kwargs.trtllm` is applied last, verbatim (a key set to null there removes ours).
    `kv_memory_fraction`: gpu_memory_utilization converted by `kv_fraction` (None: as given)."""
    max_len = max_model_len(cfg)
    fraction = cfg.gpu_memory_utilization if kv_memory_fraction is None else kv_memory_fraction
    kw: dict[str, Any] = {
        "model": model_dir,
        # LLM's `backend` argument selects the PyTorch flow; builds whose LLM is that flow only lack it.
        "backend": "pytorch" if "backend" in feats.llm_fields else None,
        "tensor_parallel_size": cfg.tensor_model_parallel_size,
        "dtype": cfg.dtype,
        "max_batch_size": cfg.max_num_seqs,
        "max_num_tokens": cfg.max_num_batched_tokens,
        "max_seq_len": max_len,
        # Its default (1024) would cut long prompts; multi-turn continuations hold the response so far.
        "max_input_len": max_len if cfg.multi_turn.enable else cfg.prompt_length,
        "load_format": "dummy" if cfg.load_format == "dummy" else "auto",
        "kv_cache_config": tllm_args_mod.KvCacheConfig(free_gpu_memory_fraction=fraction,
                                                       enable_block_reuse=cfg.enable_prefix_caching),
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": extension,
        # TensorRT-LLM's custom all-reduce was reported to hurt RL convergence across instances.
        "allreduce_strategy": "NCCL",
    }
    kw.update(graph_and_scheduler(cfg.max_num_seqs, feats.llm_fields, tllm_args_mod))
    if cfg.enable_sleep_mode:
        kw["sleep_config"] = sleep_config(tllm_args_mod, sleep_weights(cfg, feats))
    if cfg.enable_rollout_routing_replay:  # check_config refused builds without it
        kw["enable_return_routed_experts"] = True
    kw = {k: v for k, v in kw.items() if v is not None}
    user = cfg.engine_kwargs.get("trtllm") or {}
    if user.get("generation_config") is not None:
        # SamplingParams._apply_generation_config_defaults would fill min_p, no_repeat_ngram_size, ...
        # from the model's file into requests: sampling megarl's log-probs do not account for.
        raise ConfigError("engine_kwargs.trtllm.generation_config is reserved: megarl sends every sampling field "
                          "itself (the model's generation_config.json sampling defaults would change what is "
                          "sampled behind the trainer's log-probs); remove the key", f"{KEY}.engine_kwargs.trtllm")
    for key, value in user.items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    unknown = sorted(set(kw) - feats.llm_fields)
    if unknown:
        raise ConfigError(f"TensorRT-LLM {feats.version}'s LLM has no argument(s) {unknown}: remove them from "
                          "engine_kwargs.trtllm", f"{KEY}.engine_kwargs.trtllm")
    return kw


# -- sampling and log-probs ----------------------------------------------------------------------------
def end_id(sp: SamplingParams) -> int:
    """SamplingParams.end_id: the tokenizer's first EOS id; with ignore_eos, the first stop token id
    (so a greedy request still stops on one); -1 (never) when nothing may stop the response.
    TorchSampler (the 1.3 default, sampler_type "auto" without beam search: llmapi/llm_args.py)
    ends a request on `py_end_id`; its fast greedy path (_torch/pyexecutor/sampler.py,
    _can_use_fast_greedy_path) never looks at stop words, so end_id=-1 with EOS only among the
    stop ids ran greedy responses to max_tokens. verl's trtllm rollout sends end_id=-1 only with
    sampler_type="TRTLLMSampler" and the real end id otherwise."""
    eos = [] if sp.ignore_eos else list(sp.eos_token_ids)
    ids = eos or sorted(sp.stop_token_ids)
    return int(ids[0]) if ids else -1


def model_eos(model_dir: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), [] without one."""
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [] if eos is None else [int(t) for t in ([eos] if isinstance(eos, int) else eos)]


def check_model_eos(ignore_eos: bool, eos: list[int], end: int, key: str = f"{KEY}.ignore_eos") -> None:
    """SamplingParams._setup adds every generation_config.json EOS id but end_id to the stop ids,
    whatever ignore_eos says (executor/params/sampling.py at 1f064c46): ignore_eos cannot hold."""
    extra = sorted(set(eos) - {end})
    if ignore_eos and extra:
        raise ConfigError(f"ignore_eos=true, but TensorRT-LLM stops on the model's generation_config.json eos_token_id "
                          f"{extra} whatever ignore_eos says (SamplingParams._setup): remove eos_token_id from that "
                          "file in a copy of the model, or use rollout.name=vllm or native", key)


def sampling_kwargs(sp: SamplingParams, feats: Features, max_tokens: int,
                    pad_token_id: int | None = None, prompt_index: int = 0,
                    routes: bool = False, eos: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    """Arguments of tensorrt_llm.SamplingParams for prompt `prompt_index` of a call. Greedy always
    asks n=1: TensorRT-LLM refuses greedy n>1 without TLLM_ALLOW_N_GREEDY_DECODING, and greedy
    samples are identical anyway (the engine copies the one completion n times). `eos`: the
    model's generation_config.json EOS ids, which TensorRT-LLM adds to the stop ids itself; megarl
    sends them too, so the stop ids it sends are every id that ends a response."""
    mode = logprob_mode(sp)
    end = end_id(sp)
    check_model_eos(sp.ignore_eos, list(eos), end, "sampling.ignore_eos")
    kw: dict[str, Any] = {
        "n": 1 if sp.greedy else sp.n,
        "max_tokens": max_tokens,
        "temperature": 0.0 if sp.greedy else sp.temperature,
        # Neutral values rather than None: None lets a build that applies generation_config.json
        # defaults (SamplingParams._apply_generation_config_defaults) fill them from the model.
        "top_k": 0 if sp.greedy or sp.top_k == -1 else sp.top_k,          # 0: all logits
        "top_p": 1.0 if sp.greedy else sp.top_p,
        "repetition_penalty": sp.repetition_penalty,
        "seed": prompt_seed(sp.seed, prompt_index),
        # The real EOS goes in end_id: TorchSampler, the 1.3 default, stops greedy requests only
        # on it (see `end_id`). Every stop id (EOS included) is also a stop word, and the stop
        # token stays in the output (the policy learns to stop).
        "end_id": end,
        "pad_id": pad_token_id if pad_token_id is not None else (end if end != -1 else None),
        "stop_token_ids": sorted(sp.stop_ids | set(eos)) or None,
        "include_stop_str_in_output": True,
        "detokenize": False,
        # The sampled token's log-prob: with the simple format logprobs must be 0 (_validate),
        # which means the sampled token only; without it, 1 gives the sampled token plus the top 1.
        "logprobs": 0 if feats.simple_format else 1,
        "logprobs_mode": mode,
        "logprobs_simple_format": True if feats.simple_format else None,
        "return_routed_experts": True if routes else None,
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    unknown = sorted(set(kw) - feats.sampling_fields)
    if unknown:                            # would be a TypeError inside TensorRT-LLM's dataclass
        raise ConfigError(f"TensorRT-LLM {feats.version}'s SamplingParams has no field(s) {unknown}; rollouts need "
                          f"{LOGPROBS_NEEDED}", f"{KEY}.name")
    return kw


def completion_from_output(output: Any, routes: bool = False) -> Completion:
    """One tensorrt_llm CompletionOutput -> Completion: tokens and sampled-token log-probs as the
    LLM-API engines share them (rollout/llm_api.py); with `routes`, its routed_experts
    ([positions fed, MoE layers, top-k] expert ids) as a tensor."""
    done = shared_completion(output, "TensorRT-LLM")
    if not routes:
        return done
    raw = getattr(output, "routed_experts", None)
    if raw is None:
        raise RuntimeError("TensorRT-LLM returned no routed_experts for a request that asked for them "
                           "(return_routed_experts=True); a dense model has none: R3 is for MoE models")
    experts = torch.as_tensor(raw)
    if experts.dim() != 3:
        raise RuntimeError(f"TensorRT-LLM's routed_experts has shape {tuple(experts.shape)}; expected "
                           "[positions, MoE layers, top-k]")
    return dataclasses.replace(done, routed_experts=experts)
