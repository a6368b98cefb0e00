"""TensorRT-LLM behind the rollout contract (`rollout.name=trtllm`), LLM API of TensorRT-LLM 1.2,
PyTorch backend.

    engine = TRTLLMEngine(model_dir, cfg, tp_group=group)   # every rank of the rollout TP group

NOT EXECUTED IN THIS REPOSITORY'S CI: tensorrt_llm needs CUDA and installs only from NVIDIA's
package index. The pure parts (engine arguments, sampling arguments, log-prob mode, reading the
sampled token's log-prob out of result objects, weight-bucket handles) are tested on CPU with
fakes; the conformance suite runs on this engine wherever `import tensorrt_llm` works.

Layout: rank 0 of the rollout TP group owns `tensorrt_llm.LLM`, which starts its own TP workers
(Ray orchestrator) on the group's GPUs. Every rank calls generate(); rank 0 generates and
broadcasts the completions. A weight bucket: each rank puts the full tensors on its own GPU,
makes CUDA-IPC handles keyed by its device UUID, rank 0 gathers them and calls the worker
extension's `update_weights(handles)` (partial load); `finalize_weights` calls it with None
(post-load processing, prefix-cache reset) once every expected tensor has arrived.

Log-probs: the trainer computes log_softmax(logits / T) of the sampled token, before top-k/top-p
and penalties. TensorRT-LLM reports either "raw" (log_softmax(logits), before temperature) or
"processed" (after temperature, penalties, top-k/top-p). `logprob_mode` picks the one that equals
the trainer's value, and falls back to the returned generation logits when neither does.
"""
from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.errors import ConfigError
from megarl.rollout.base import BaseRollout, Completion, SamplingParams, admit
from megarl.rollout.config import RolloutConfig
from megarl.rollout.native.tp import TPComm
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState

WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
# Memory tags released by sleep() and restored by wake() (TensorRT-LLM's executor memory types).
SLEEP_TAGS = ["sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra",
              "executor_extra", "model", "draft_model", "kv_cache"]


def require_tensorrt_llm():
    try:
        import tensorrt_llm
    except Exception as err:  # ImportError, or a CUDA/driver error raised while importing
        raise ImportError(
            f"rollout.name=trtllm needs the tensorrt_llm package (TensorRT-LLM >= 1.2), which does not import "
            f"here ({type(err).__name__}: {err}). Install it on a CUDA machine from NVIDIA's index "
            "(pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com), or use rollout.name=native"
        ) from err
    return tensorrt_llm


def llm_kwargs(cfg: RolloutConfig, model_dir: str, kv_cache_config_cls: Any) -> dict[str, Any]:
    """Arguments of tensorrt_llm.LLM from the rollout config; `engine_kwargs.trtllm` is applied last,
    verbatim (a key set to null there removes ours)."""
    max_len = cfg.max_model_len or ((cfg.prompt_length or 0) + (cfg.response_length or 0)) or None
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
        "kv_cache_config": kv_cache_config_cls(free_gpu_memory_fraction=cfg.gpu_memory_utilization,
                                               enable_block_reuse=cfg.enable_prefix_caching),
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep": cfg.enable_sleep_mode,
        # TensorRT-LLM's custom all-reduce was reported to hurt RL convergence across instances.
        "allreduce_strategy": "NCCL",
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    for key, value in (cfg.engine_kwargs.get("trtllm") or {}).items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    return kw


def logprob_mode(sp: SamplingParams) -> str:
    """Which TensorRT-LLM log-prob equals the trainer's log_softmax(logits / T) of the sampled token.

    raw        log_softmax(logits): right when T is 1 (greedy counts as T=1 in the convention)
    processed  after temperature, penalties and top-k/top-p: right when only temperature applies
    logits     neither: return the generation logits and compute it here (V floats per token)
    """
    if sp.greedy or sp.temperature == 1.0:
        return "raw"
    if sp.top_k == -1 and sp.top_p == 1.0 and sp.repetition_penalty == 1.0:
        return "processed"
    return "logits"


def sampling_kwargs(sp: SamplingParams, pad_token_id: int | None = None) -> dict[str, Any]:
    """Arguments of tensorrt_llm.SamplingParams for one generate() call."""
    mode = logprob_mode(sp)
    kw: dict[str, Any] = {
        "n": sp.n,
        "max_tokens": sp.max_tokens,
        "temperature": 0.0 if sp.greedy else sp.temperature,
        "top_k": None if sp.top_k == -1 else sp.top_k,
        "top_p": None if sp.top_p == 1.0 else sp.top_p,
        "repetition_penalty": None if sp.repetition_penalty == 1.0 else sp.repetition_penalty,
        "seed": sp.seed,
        # EOS handling is ours: end_id=-1 turns the built-in one off, stop_token_ids carry EOS
        # unless ignore_eos, and the stop token stays in the output (the policy learns to stop).
        "end_id": -1,
        "pad_id": pad_token_id,
        "stop_token_ids": sorted(sp.stop_ids) or None,
        "include_stop_str_in_output": True,
        "detokenize": False,
        "logprobs": 1,                     # top-1 plus the sampled token; we read the sampled one
        "logprobs_mode": "processed" if mode == "processed" else "raw",
        "return_generation_logits": mode == "logits",
    }
    return {k: v for k, v in kw.items() if v is not None}


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def completion_from_output(output: Any, sp: SamplingParams) -> Completion:
    """One tensorrt_llm CompletionOutput -> Completion with the *sampled* token's log-probs."""
    tokens = [int(t) for t in output.token_ids]
    if logprob_mode(sp) == "logits":
        logits = output.generation_logits
        if logits is None or logits.shape[0] < len(tokens):
            raise RuntimeError("TensorRT-LLM returned no generation logits although return_generation_logits=True")
        lp_all = torch.log_softmax(logits[: len(tokens)].float() / sp.logprob_temperature, dim=-1)
        logps = lp_all.gather(-1, torch.tensor(tokens, device=lp_all.device)[:, None]).squeeze(-1).tolist()
    else:
        per_token = output.logprobs or []
        if len(per_token) != len(tokens):
            raise RuntimeError(f"TensorRT-LLM returned {len(per_token)} log-prob entries for {len(tokens)} tokens")
        logps = []
        for pos, (tok, entry) in enumerate(zip(tokens, per_token)):
            if isinstance(entry, dict):
                if tok not in entry:         # never take another entry of the dict
                    raise RuntimeError(f"TensorRT-LLM log-probs at position {pos} lack the sampled token {tok} "
                                       f"(entries for {sorted(entry)[:5]})")
                logps.append(_logprob_value(entry[tok]))
            else:                            # the flat list[float] format: the sampled token's value
                logps.append(float(entry))
    reason = {"stop": "stop", "length": "length"}.get(str(output.finish_reason), "abort")
    return Completion(tokens, logps, reason)


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


class TRTLLMEngine(BaseRollout):
    def __init__(self, model_dir: str, cfg: RolloutConfig, *, tp_group=None, pad_token_id: int | None = None,
                 expected_names: list[str] | None = None, device: str | torch.device | None = None):
        super().__init__(cfg, role="rollout")
        self.comm = TPComm(tp_group)
        self.leader = self.comm.rank == 0
        if self.comm.size not in (1, cfg.tensor_model_parallel_size):
            raise ConfigError(f"the rollout TP group has {self.comm.size} ranks but tensor_model_parallel_size="
                              f"{cfg.tensor_model_parallel_size}", "actor_rollout_ref.rollout.tensor_model_parallel_size")
        self.tllm = require_tensorrt_llm()
        from tensorrt_llm._torch.utils import get_device_uuid
        # Where this rank's bucket tensors live for the IPC handles: its own GPU.
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.device_uuid = get_device_uuid(self.device.index or 0)
        self.pad_token_id = pad_token_id
        self.guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation)
        names = expected_names if expected_names is not None else checkpoint_names(model_dir)
        self.weights = WeightState(names, ready=cfg.load_format != "dummy")
        self.llm = None
        if self.leader:
            from tensorrt_llm.llmapi import KvCacheConfig
            self.llm = self.tllm.LLM(**llm_kwargs(cfg, model_dir, KvCacheConfig))
        self.asleep = False

    def _rpc(self, method: str, *args) -> None:
        if self.leader:
            self.llm._collective_rpc(method, args)
        self.comm.barrier()                  # handles stay valid (tensors alive) until consumed

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling)
        groups = None
        if self.leader:
            params = self.tllm.SamplingParams(**sampling_kwargs(sampling, self.pad_token_id))
            outputs = self.llm.generate(prompts, params)
            groups = [[completion_from_output(o, sampling) for o in out.outputs] for out in outputs]
        if self.comm.size > 1:
            box = [groups]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.comm.group, 0), group=self.comm.group)
            groups = box[0]
        return groups

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.asleep:                      # the model's memory must be back before loading into it
            self.wake()
        self.weights.begin_bucket()
        named = [(name, t.to(self.device)) for name, t in bucket]
        mine = bucket_handles(named, self.device_uuid)
        if self.comm.size > 1:
            gathered = [None] * self.comm.size if self.leader else None
            dist.gather_object(mine, gathered, dst=dist.get_global_rank(self.comm.group, 0), group=self.comm.group)
        else:
            gathered = [mine]
        merged = {uuid: h for part in gathered for uuid, h in part.items()} if self.leader else None
        self._rpc("update_weights", merged)
        for name, _ in named:
            self.weights.received(name)

    def finalize_weights(self) -> None:
        self.weights.finalize()              # refuses (and keeps refusing generate) if a tensor is missing
        self._rpc("update_weights", None)

    def abort_weight_update(self) -> None:
        self.weights.abort()

    def sleep(self) -> None:
        self._rpc("sleep", SLEEP_TAGS)
        self.asleep = True

    def wake(self) -> None:
        self._rpc("wakeup", SLEEP_TAGS)
        self.asleep = False
