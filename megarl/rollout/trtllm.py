"""TensorRT-LLM behind the rollout contract (`rollout.name=trtllm`), LLM API, PyTorch backend.

    engine = TRTLLMEngine(model_dir, cfg, tp_group=group)   # every rank of the rollout TP group

NEVER EXECUTED IN THIS REPOSITORY: tensorrt_llm needs CUDA and installs only from NVIDIA's index.
Everything here is checked on CPU against conformance fakes built from TensorRT-LLM's own
signatures (tests/assets/trtllm/*.json, tests/rollout/trtllm_fake.py); the conformance suite
runs on the real package wherever `import tensorrt_llm` works.

Versions, by feature detection (never by version string; `detect_features`):
  SamplingParams.logprobs_mode         (1.3+, PR #9675) raw / processed log-probs. Without it
                                       (1.2.x) the log-probs are top-K dicts that may omit the
                                       sampled token, and nothing else in 1.2's LLM API returns
                                       the sampled token's log-prob short of the full generation
                                       logits (V floats per token): 1.2 is refused for rollouts.
                                       (verl on 1.2 reads sampler_type="TRTLLMSampler" dicts; how
                                       that C++ sampler's values treat temperature and top-k could
                                       not be verified from the source, so it is not relied on.)
  SamplingParams.logprobs_simple_format one float per token (the sampled token's) where it exists
  LLM arg sleep_config / enable_sleep  1.3+ SleepConfig(restore_modes) / 1.2's switch

Log-probs: the trainer scores log_softmax(logits / T) of the sampled token, before top-k/top-p
and penalties (greedy: T=1). TensorRT-LLM reports "raw" (log_softmax(logits): before temperature)
or "processed" (after temperature, penalties and top-k/top-p). raw is exact when T=1 (or greedy);
processed when only temperature applies. Any other mix has no exact source and is refused with
the fix; the generation logits are never requested (no full-vocabulary transfer, ever).

Layout: rank 0 of the rollout TP group owns `tensorrt_llm.LLM`, whose Ray workers megarl places on
exactly the group's GPUs and checks by device UUID (megarl/rollout/trtllm_placement.py). Every
rank calls generate(); rank 0 generates and broadcasts. A weight bucket: each rank puts the full
tensors on its own GPU, makes CUDA-IPC handles keyed by its device UUID; rank 0 gathers them and
calls the worker extension's `update_weights(handles)`; `finalize_weights` calls it with None once
every tensor has arrived.

Sleep (only with enable_sleep_mode=True; free_cache_engine=True without it is refused): the KV
cache is released (restore mode NONE); the weights stay on the GPU (load_format=auto) or are
released without a host copy (restore mode NONE, load_format=dummy: the next full sync rewrites
them). A sync while asleep resumes the weights only; the KV cache comes back in wake(), after
the refit, so the two are never resident together with a bucket in flight.
"""
from __future__ import annotations

import atexit
import base64
import dataclasses
import inspect
import logging
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.errors import ConfigError
from megarl.rollout.base import BaseRollout, Completion, SamplingParams, admit
from megarl.rollout.config import RolloutConfig
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState

log = logging.getLogger(__name__)
_KEY = "actor_rollout_ref.rollout"
KV_TAG = "kv_cache"
# The memory tags of TensorRT-LLM's executor (ExecutorMemoryType values) when the enum cannot be read.
DEFAULT_TAGS = ("sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra",
                "executor_extra", "model", "draft_model", KV_TAG)
LOGPROBS_NEEDED = ("TensorRT-LLM >= 1.3 (SamplingParams.logprobs_mode, PR #9675)")


def require_tensorrt_llm():
    try:
        import tensorrt_llm
    except Exception as err:  # ImportError, or a CUDA/driver error raised while importing
        raise ImportError(
            f"rollout.name=trtllm needs the tensorrt_llm package ({LOGPROBS_NEEDED}), which does not import "
            f"here ({type(err).__name__}: {err}). Install it on a CUDA machine from NVIDIA's index "
            "(pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com), or use rollout.name=native"
        ) from err
    return tensorrt_llm


# -- feature detection ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Features:
    version: str
    sampling_fields: frozenset[str]        # SamplingParams' init fields
    llm_fields: frozenset[str]             # what LLM(...) accepts: its args model's fields + named params
    memory_tags: tuple[str, ...]           # ExecutorMemoryType values

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

    def summary(self) -> str:
        return (f"TensorRT-LLM {self.version}: logprobs_mode={self.logprobs_mode} "
                f"logprobs_simple_format={self.simple_format} sleep={self.sleep or 'none'}")


def _init_params(fn) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def detect_features(tllm) -> Features:
    """What this tensorrt_llm accepts, read from its classes (dataclass fields, pydantic model fields,
    the LLM constructor's named parameters), not from its version string."""
    sampling = frozenset(f.name for f in dataclasses.fields(tllm.SamplingParams) if f.init)
    from tensorrt_llm.llmapi import llm_args as args_mod
    model = getattr(args_mod, "TorchLlmArgs", None) or getattr(args_mod, "LlmArgs")
    llm = frozenset(set(getattr(model, "model_fields", {})) | _init_params(tllm.LLM.__init__))
    mem = getattr(args_mod, "ExecutorMemoryType", None)
    tags = tuple(m.value for m in mem if not str(m.value).startswith("_")) if mem is not None else DEFAULT_TAGS
    return Features(str(getattr(tllm, "__version__", "?")), sampling, llm, tags)


# -- engine arguments --------------------------------------------------------------------------------
def max_model_len(cfg: RolloutConfig) -> int | None:
    if cfg.max_model_len:
        return cfg.max_model_len
    if cfg.prompt_length and cfg.response_length:
        return cfg.prompt_length + cfg.response_length
    return None


def sleep_weights(cfg: RolloutConfig) -> str:
    """What sleep() does with the weights: "drop" (released, no host copy; the next full sync
    rewrites them) when they come from syncs (load_format=dummy), else "keep" (stay on the GPU)."""
    return "drop" if cfg.load_format == "dummy" else "keep"


def check_config(cfg: RolloutConfig, feats: Features) -> None:
    """Refusals that need no GPU: each one line with the fix, before anything starts."""
    if not feats.logprobs_mode:
        raise ConfigError(f"TensorRT-LLM {feats.version} cannot return the sampled token's log-prob exactly (its top-K "
                          f"log-probs may omit the sampled token); rollouts need {LOGPROBS_NEEDED}: upgrade "
                          "tensorrt_llm or use rollout.name=native", f"{_KEY}.name")
    if cfg.free_cache_engine and not cfg.enable_sleep_mode:
        raise ConfigError("free_cache_engine=true needs enable_sleep_mode=true with rollout.name=trtllm (TensorRT-LLM "
                          "frees its memory only with sleep support built in); set enable_sleep_mode=true or "
                          "free_cache_engine=false", f"{_KEY}.free_cache_engine")
    if cfg.enable_sleep_mode and feats.sleep is None:
        raise ConfigError(f"TensorRT-LLM {feats.version} has no sleep support (neither sleep_config nor enable_sleep); "
                          "set enable_sleep_mode=false and free_cache_engine=false", f"{_KEY}.enable_sleep_mode")
    if cfg.enable_sleep_mode and feats.sleep == "enable_sleep":
        # enable_sleep alone has no per-tag restore modes: megarl could not keep the weights in place
        # nor drop them without a host copy.
        raise ConfigError(f"TensorRT-LLM {feats.version} offers only enable_sleep, without restore modes; megarl needs "
                          "SleepConfig(restore_modes) (TensorRT-LLM >= 1.3), or set enable_sleep_mode=false and "
                          "free_cache_engine=false", f"{_KEY}.enable_sleep_mode")
    logprob_mode(SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                repetition_penalty=cfg.repetition_penalty, do_sample=cfg.do_sample))


def sleep_config(tllm_args_mod, feats: Features, weights: str):
    """SleepConfig(restore_modes): KV cache NONE (nothing in it outlives a step); the weights NONE
    when dropped, and left out of sleep entirely when kept (never a PINNED host round trip)."""
    mem = tllm_args_mod.ExecutorMemoryType
    modes = {mem(KV_TAG): "NONE"}
    if weights == "drop":
        modes.update({mem(t): "NONE" for t in feats.memory_tags if t != KV_TAG})
    return tllm_args_mod.SleepConfig(restore_modes=modes)


def llm_kwargs(cfg: RolloutConfig, model_dir: str, feats: Features, tllm_args_mod: Any,
               extension: str | None = None) -> dict[str, Any]:
    """Arguments of tensorrt_llm.LLM from the rollout config, only those this version has;
    `engine_kwargs.trtllm` is applied last, verbatim (a key set to null there removes ours)."""
    max_len = max_model_len(cfg)
    kw: dict[str, Any] = {
        "model": model_dir,
        "backend": "pytorch",
        "tensor_parallel_size": cfg.tensor_model_parallel_size,
        "dtype": cfg.dtype,
        "max_batch_size": cfg.max_num_seqs,
        "max_num_tokens": cfg.max_num_batched_tokens,
        "max_seq_len": max_len,
        # Its default (1024) would cut long prompts; multi-turn continuations hold the response so far.
        "max_input_len": max_len if cfg.multi_turn.enable else cfg.prompt_length,
        "load_format": "dummy" if cfg.load_format == "dummy" else "auto",
        "kv_cache_config": tllm_args_mod.KvCacheConfig(free_gpu_memory_fraction=cfg.gpu_memory_utilization,
                                                       enable_block_reuse=cfg.enable_prefix_caching),
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": extension,
        # TensorRT-LLM's custom all-reduce was reported to hurt RL convergence across instances.
        "allreduce_strategy": "NCCL",
    }
    if cfg.enable_sleep_mode:
        kw["sleep_config"] = sleep_config(tllm_args_mod, feats, sleep_weights(cfg))
    kw = {k: v for k, v in kw.items() if v is not None}
    for key, value in (cfg.engine_kwargs.get("trtllm") or {}).items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    unknown = sorted(set(kw) - feats.llm_fields)
    if unknown:
        raise ConfigError(f"TensorRT-LLM {feats.version}'s LLM has no argument(s) {unknown}: remove them from "
                          "engine_kwargs.trtllm", f"{_KEY}.engine_kwargs.trtllm")
    return kw


# -- sampling and log-probs ----------------------------------------------------------------------------
def logprob_mode(sp: SamplingParams) -> str:
    """Which TensorRT-LLM log-prob equals the trainer's log_softmax(logits / T) of the sampled token:
    raw when T is 1 (greedy counts as T=1), processed when only temperature applies; else refused."""
    if sp.greedy or sp.temperature == 1.0:
        return "raw"
    if sp.top_k == -1 and sp.top_p == 1.0 and sp.repetition_penalty == 1.0:
        return "processed"
    raise ConfigError(f"temperature={sp.temperature} together with top_k={sp.top_k}/top_p={sp.top_p}/"
                      f"repetition_penalty={sp.repetition_penalty}: TensorRT-LLM reports log-probs before temperature "
                      "(raw) or after top-k/top-p and penalties (processed), never the trainer's "
                      "log_softmax(logits/T); "
                      "set temperature=1.0, or drop top_k/top_p/repetition_penalty, or use rollout.name=native",
                      f"{_KEY}.temperature")


def response_budget(sp: SamplingParams, prompt_len: int, max_len: int | None) -> int:
    """max_tokens = min(response budget, room left in max_model_len after the prompt)."""
    room = sp.max_tokens if max_len is None else min(sp.max_tokens, max_len - prompt_len)
    if room < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room in max_model_len={max_len}; "
                         "raise max_model_len or shorten the prompt (prompt_length / prompt_truncation=left)")
    return room


def sampling_kwargs(sp: SamplingParams, feats: Features, max_tokens: int,
                    pad_token_id: int | None = None) -> dict[str, Any]:
    """Arguments of tensorrt_llm.SamplingParams for one prompt. Greedy always asks n=1: TensorRT-LLM
    refuses greedy n>1 without TLLM_ALLOW_N_GREEDY_DECODING, and greedy samples are identical
    anyway (the engine copies the one completion n times)."""
    mode = logprob_mode(sp)
    kw: dict[str, Any] = {
        "n": 1 if sp.greedy else sp.n,
        "max_tokens": max_tokens,
        "temperature": 0.0 if sp.greedy else sp.temperature,
        "top_k": None if sp.greedy or sp.top_k == -1 else sp.top_k,
        "top_p": None if sp.greedy or sp.top_p == 1.0 else sp.top_p,
        "repetition_penalty": None if sp.repetition_penalty == 1.0 else sp.repetition_penalty,
        "seed": sp.seed,
        # EOS handling is ours: end_id=-1 turns the built-in one off, stop_token_ids carry EOS
        # unless ignore_eos, and the stop token stays in the output (the policy learns to stop).
        "end_id": -1,
        "pad_id": pad_token_id,
        "stop_token_ids": sorted(sp.stop_ids) or None,
        "include_stop_str_in_output": True,
        "detokenize": False,
        "logprobs": 1,                    # the sampled token's (1.3+ always includes it)
        "logprobs_mode": mode,
        "logprobs_simple_format": True if feats.simple_format else None,
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    unknown = sorted(set(kw) - feats.sampling_fields)
    if unknown:                            # would be a TypeError inside TensorRT-LLM's dataclass
        raise ConfigError(f"TensorRT-LLM {feats.version}'s SamplingParams has no field(s) {unknown}; rollouts need "
                          f"{LOGPROBS_NEEDED}", f"{_KEY}.name")
    return kw


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def completion_from_output(output: Any) -> Completion:
    """One tensorrt_llm CompletionOutput -> Completion with the *sampled* token's log-probs, read from
    the simple format (one float per token) or the dict format ({token id: Logprob})."""
    tokens = [int(t) for t in output.token_ids]
    per_token = output.logprobs or []
    if len(per_token) != len(tokens):
        raise RuntimeError(f"TensorRT-LLM returned {len(per_token)} log-prob entries for {len(tokens)} tokens")
    logps = []
    for pos, (tok, entry) in enumerate(zip(tokens, per_token)):
        if isinstance(entry, dict):
            if tok not in entry:          # never take another entry of the dict
                raise RuntimeError(f"TensorRT-LLM log-probs at position {pos} lack the sampled token {tok} "
                                   f"(entries for {sorted(entry)[:5]})")
            logps.append(_logprob_value(entry[tok]))
        else:
            logps.append(float(entry))
    reason = {"stop": "stop", "length": "length"}.get(str(output.finish_reason), "abort")
    return Completion(tokens, logps, reason)


# -- weights -----------------------------------------------------------------------------------------
def bucket_handles(named: Iterable[tuple[str, torch.Tensor]], device_uuid: str) -> dict[str, str]:
    """{device UUID: base64 of pickled [(HF name, torch IPC handle)]}, the worker extension's format."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = [(name, reduce_tensor(t.detach().contiguous())) for name, t in named]
    return {device_uuid: base64.b64encode(pickle.dumps(handles)).decode("ascii")}


def checkpoint_names(model_dir: str) -> list[str]:
    """Tensor names of an HF checkpoint (what a full sync must deliver), from safetensors headers."""
    import glob
    import os

    from safetensors import safe_open
    names: list[str] = []
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return [n for n in names if not n.endswith("rotary_emb.inv_freq")]


class _Group:
    """Rank and size in the rollout TP group (one rank without a group)."""

    def __init__(self, group):
        self.group = group
        if group is None or not dist.is_initialized():
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def leader(self) -> int:
        return dist.get_global_rank(self.group, 0)

    def gather(self, obj):
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.leader(), group=self.group)
        return out

    def all_gather(self, obj):
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader(), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def _vocab_size(model_dir: str) -> int | None:
    import json
    import os
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("vocab_size")
    except OSError:
        return None


def _logprob_mode_enum():
    """1.3's SamplingParams.logprobs_mode takes its LogprobMode enum where one is defined."""
    try:
        from tensorrt_llm.sampling_params import LogprobMode
    except ImportError:
        return None
    return LogprobMode


class TRTLLMEngine(BaseRollout):
    # temperature with top-k/top-p/penalty has no exact log-prob here: refused (see logprob_mode)
    refuses_truncated_temperature = True

    def __init__(self, model_dir: str, cfg: RolloutConfig, *, tp_group=None, pad_token_id: int | None = None,
                 expected_names: list[str] | None = None, device: str | torch.device | None = None):
        super().__init__(cfg, role="rollout")
        from megarl.rollout import trtllm_placement as placement
        self.comm = _Group(tp_group)
        self.leader = self.comm.rank == 0
        if self.comm.size not in (1, cfg.tensor_model_parallel_size):
            raise ConfigError(f"the rollout TP group has {self.comm.size} ranks but tensor_model_parallel_size="
                              f"{cfg.tensor_model_parallel_size}", f"{_KEY}.tensor_model_parallel_size")
        self.tllm = require_tensorrt_llm()
        self.features = detect_features(self.tllm)
        if self.leader:
            log.info(self.features.summary())
        check_config(cfg, self.features)
        self.max_len = max_model_len(cfg)
        self.sleep_weights = sleep_weights(cfg)
        from tensorrt_llm._torch.utils import get_device_uuid
        # Where this rank's bucket tensors live for the IPC handles: its own GPU.
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.device_uuid = get_device_uuid(self.device.index or 0)
        members = self.comm.all_gather((placement.host_name(), self.device_uuid))
        self.group_uuids = placement.group_devices(members, cfg.tensor_model_parallel_size)
        self.pad_token_id = pad_token_id
        self.guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation, vocab_size=_vocab_size(model_dir))
        names = expected_names if expected_names is not None else checkpoint_names(model_dir)
        self.weights = WeightState(names, ready=cfg.load_format != "dummy")
        self.llm = None
        self.released: set[str] = set()
        self.asleep = False
        from tensorrt_llm.llmapi import llm_args
        # Built on every rank, so a bad engine_kwargs key stops every rank alike.
        kw = llm_kwargs(cfg, model_dir, self.features, llm_args, extension=placement.EXTENSION)

        def start():
            try:
                with placement.only_devices(self.group_uuids):
                    self.llm = self.tllm.LLM(**kw)
                placement.check_worker_devices(self.llm._collective_rpc("report_device_id"), self.group_uuids)
            except BaseException:
                self.close()
                raise
            atexit.register(self.close)      # the Ray instance TensorRT-LLM started goes with the process
        self._on_leader(start)

    def close(self) -> None:
        """Shut the LLM down, and with it the Ray instance it started (leader only; idempotent)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()

    def _on_leader(self, fn):
        """Run fn on the leader; every rank gets its result, or an error if it failed, so no rank is
        left waiting in a collective. Also a barrier: IPC handles stay valid until consumed."""
        if self.leader:
            try:
                result = fn()
            except BaseException as err:
                self.comm.broadcast((None, f"{type(err).__name__}: {err}"))
                raise
        result, failure = self.comm.broadcast((result, None) if self.leader else (None, None))
        if failure:
            raise RuntimeError(f"the rollout TP group's leader failed in TensorRT-LLM: {failure}")
        return result

    def _rpc(self, method: str, *args) -> None:
        self._on_leader(lambda: self.llm._collective_rpc(method, args))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling, prompt_limit)
        # On every rank (same prompts everywhere), so a refusal stops every rank alike.
        kws = [sampling_kwargs(sampling, self.features, response_budget(sampling, len(p), self.max_len),
                               self.pad_token_id) for p in prompts]
        return self._on_leader(lambda: self._generate(prompts, kws, sampling))

    def _generate(self, prompts, kws, sampling: SamplingParams) -> list[list[Completion]]:
        mode_enum = _logprob_mode_enum()
        if mode_enum is not None:
            kws = [{**kw, "logprobs_mode": mode_enum(kw["logprobs_mode"])} for kw in kws]
        outputs = self.llm.generate(prompts, [self.tllm.SamplingParams(**kw) for kw in kws])
        groups = [[completion_from_output(o) for o in out.outputs] for out in outputs]
        if sampling.greedy and sampling.n > 1:
            groups = [[dataclasses.replace(g[0], token_ids=list(g[0].token_ids), log_probs=list(g[0].log_probs))
                       for _ in range(sampling.n)] for g in groups]
        return groups

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        weight_tags = [t for t in self.released if t != KV_TAG]
        if weight_tags:                      # the weights' memory only: the KV cache wakes after the refit
            self._rpc("wakeup", weight_tags)
            self.released -= set(weight_tags)
        self.weights.begin_bucket()
        named = [(name, t.to(self.device)) for name, t in bucket]
        parts = self.comm.gather(bucket_handles(named, self.device_uuid))
        merged = {uuid: h for part in parts for uuid, h in part.items()} if self.leader else None
        self._rpc("update_weights", merged)
        for name, _ in named:
            self.weights.received(name)

    def finalize_weights(self) -> None:
        self.weights.finalize()              # refuses (and keeps refusing generate) if a tensor is missing
        self._rpc("update_weights", None)

    def abort_weight_update(self) -> None:
        self.weights.abort()

    def sleep(self) -> None:
        if not self.cfg_sleep:
            raise RuntimeError("this trtllm engine was built with enable_sleep_mode=false: it cannot sleep")
        if self.asleep:
            return
        tags = [KV_TAG] + ([t for t in self.features.memory_tags if t != KV_TAG]
                           if self.sleep_weights == "drop" else [])
        self._rpc("sleep", tags)
        self.released |= set(tags)
        if self.sleep_weights == "drop":
            self.weights.release()           # restore mode NONE: their content is gone until a full sync
        self.asleep = True

    def wake(self) -> None:
        if not self.cfg_sleep:
            raise RuntimeError("this trtllm engine was built with enable_sleep_mode=false: it cannot wake")
        if self.released:
            self._rpc("wakeup", sorted(self.released, key=lambda t: t == KV_TAG))
            self.released = set()
        self.asleep = False

    @property
    def cfg_sleep(self) -> bool:
        return bool(self.config.enable_sleep_mode)
