"""TensorRT-LLM behind the rollout contract (`rollout.name=trtllm`), LLM API, PyTorch backend.

    engine = TRTLLMEngine(model_dir, cfg, tp_group=group)   # every rank of the rollout TP group
    python benchmarks/trtllm_check.py --model <hf dir>       # first thing to run on a GPU node

NEVER EXECUTED AGAINST REAL TENSORRT-LLM: tensorrt_llm needs CUDA and installs only from NVIDIA's
index. Everything here is checked on CPU against conformance fakes built from TensorRT-LLM's own
source (tests/assets/trtllm/*.json, each field with its path and commit;
tests/rollout/trtllm_fake.py); the conformance suite runs on the real package wherever
`import tensorrt_llm` works, and benchmarks/trtllm_check.py is the procedure for a GPU node.

Pieces: what is asked of TensorRT-LLM (features, arguments, log-probs, the sleep plan) in
args.py; where its workers run in placement.py; the TP group and IPC handles in
comm.py.

Layout: rank 0 of the rollout TP group owns `tensorrt_llm.LLM`, whose Ray workers megarl places on
exactly the group's GPUs and checks by device UUID. Every rank calls generate(); rank 0 generates
and broadcasts; the others wait on a gloo group whose timeout (`wait_timeout_s`, a day by
default) outlasts start-up and long rollouts (comm.py says why). A weight bucket: each rank
puts the full tensors on its own GPU, makes CUDA-IPC
handles keyed by its device UUID; rank 0 gathers them and calls the worker extension's
`update_weights(handles)`; `finalize_weights` calls it with None once every tensor has arrived.

Sleep (only with enable_sleep_mode=True): releases every memory tag (LLM.release/resume where the
class has them, else the workers' sleep/wakeup RPCs), after wait_for_engine_idle where the workers
have it; restore mode NONE for the KV cache and, when the weights come from syncs, the
`model_weights` tag, a host copy for the rest (args.py says why). A sync while asleep resumes
every tag but the KV cache; the KV cache comes back in wake(), after the refit, so it is never
resident with a bucket in flight.
finalize_weights() and wake() reset the prefix cache (the worker extension's
reset_prefix_cache), so block reuse never serves KV computed with other weights or lost in a sleep.

A failed sync: TensorRT-LLM rewrites the live weights from a sync's first bucket on
(pre_reload_weights), so any failure after it marks them mixed and generate() refuses until a full
sync; builds with abort_update_weights get it on every worker (`_torn`).

Ray: the leaders of a job on a node share one Ray cluster, the job's (node_ray.py): the first
starts it, the others attach by its recorded address, and each LLM's workers take the bundles of
the node's placement group that hold its ranks' GPUs. TLLM_RAY_FORCE_LOCAL_CLUSTER=1, set by the
user, gives each group's LLM a Ray of its own, shut down with it (placement.py, `check_process_ray`).
megarl's own Ray pools do not share a leader's process with either (docs/trtllm.md says why).
"""
from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterable

import torch

from megarl.config.errors import ConfigError
from megarl.rollout.base import BaseRollout, Completion, SamplingParams, admit
from megarl.rollout.build_args import BuildRequest, pad_id
from megarl.rollout.config import RolloutConfig
from megarl.rollout.llm_api import copy_greedy
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.trtllm import node_ray, placement, resources
from megarl.rollout.trtllm.args import (KEY, KV_TAG, WEIGHTS_TAG, check_config, check_model_eos, completion_from_output,
                                        detect_features, llm_kwargs, max_model_len, model_eos, require_tensorrt_llm,
                                        response_budget, sampling_classes, sampling_kwargs, sleep_tags,
                                        sleep_weights)
from megarl.rollout.trtllm.comm import WAIT_TIMEOUT_S, Group, bucket_handles, checkpoint_names, vocab_size
from megarl.rollout.weight_state import WeightState

log = logging.getLogger(__name__)


class TRTLLMEngine(BaseRollout):
    # temperature with top-k/top-p/penalty has no exact log-prob here: refused (see logprob_mode)
    refuses_truncated_temperature = True
    # A sync's first bucket rewrites the live parameters (pre_reload_weights): once one reached
    # TensorRT-LLM, a failed sync leaves no old weights to keep.
    keeps_weights_on_failed_sync = False

    def __init__(self, model_dir: str, cfg: RolloutConfig, *, tp_group=None, pad_token_id: int | None = None,
                 expected_names: list[str] | None = None, device: str | torch.device | None = None,
                 wait_timeout_s: float = WAIT_TIMEOUT_S):
        super().__init__(cfg, role="rollout")
        self.comm = Group(tp_group, wait_timeout_s)   # followers wait on a gloo group of their own
        self.leader = self.comm.rank == 0
        if self.comm.size not in (1, cfg.tensor_model_parallel_size):
            raise ConfigError(f"the rollout TP group has {self.comm.size} ranks but tensor_model_parallel_size="
                              f"{cfg.tensor_model_parallel_size}", f"{KEY}.tensor_model_parallel_size")
        self.tllm = require_tensorrt_llm()
        self.features = detect_features(self.tllm)
        if self.leader:
            log.info(self.features.summary())
        check_config(cfg, self.features)
        self.max_len = max_model_len(cfg)
        self.eos = model_eos(model_dir)      # TensorRT-LLM stops on these too (args.py check_model_eos)
        check_model_eos(bool(cfg.ignore_eos), self.eos, min(cfg.stop_token_ids, default=-1))
        self.sleep_weights = sleep_weights(cfg, self.features)
        self.routes = bool(cfg.enable_rollout_routing_replay)   # check_config refused builds without them
        if cfg.enable_sleep_mode and cfg.load_format == "dummy" and self.sleep_weights == "keep" and self.leader:
            log.info("TensorRT-LLM %s has no %s memory tag: sleep copies the weights to host memory with the "
                     "model's other buffers instead of discarding them", self.features.version, WEIGHTS_TAG)
        from tensorrt_llm._torch.utils import get_device_uuid  # optional dependency (megarl[trtllm])
        # Where this rank's bucket tensors live for the IPC handles: its own GPU.
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        index = self.device.index or 0
        self.device_uuid = get_device_uuid(index)
        ordinal = placement.device_ordinal(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        members = self.comm.all_gather((placement.host_name(), self.device_uuid, ordinal))
        self.group_uuids, self.group_ordinals = placement.group_devices(members, cfg.tensor_model_parallel_size)
        self.pad_token_id = pad_token_id
        self.guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation, vocab_size=vocab_size(model_dir))
        names = expected_names if expected_names is not None else checkpoint_names(model_dir)
        self.weights = WeightState(names, ready=cfg.load_format != "dummy")
        self.reloading = False               # a bucket of the current sync reached TensorRT-LLM
        self.llm = None
        self.released: set[str] = set()
        self.asleep = False
        from tensorrt_llm.llmapi import llm_args  # optional dependency (megarl[trtllm])
        # Built on every rank, so a bad engine_kwargs key stops every rank alike.
        kw = llm_kwargs(cfg, model_dir, self.features, llm_args, extension=placement.EXTENSION,
                        kv_memory_fraction=self._kv_fraction(cfg, model_dir))

        own_ray = os.environ.get("TLLM_RAY_FORCE_LOCAL_CLUSTER") == "1"   # the user's explicit choice
        if not own_ray and set(kw) & set(placement.PLACEMENT_KEYS):
            raise ConfigError(f"engine_kwargs.trtllm.{sorted(set(kw) & set(placement.PLACEMENT_KEYS))[0]} is megarl's: "
                              "it places each TP group's workers on its ranks' GPUs in the node's Ray cluster; "
                              "remove the key", f"{KEY}.engine_kwargs.trtllm")

        def start():
            if own_ray:
                log.info("TLLM_RAY_FORCE_LOCAL_CLUSTER=1: TensorRT-LLM starts a Ray instance of its own for this "
                         "rollout TP group (one per group, not one per node); unset it to share the node's")
                placement.check_process_ray()
                where = {}
            else:
                where = self._node_placement(llm_args)
            try:
                with placement.worker_env(self.group_ordinals if own_ray else None, self.tllm):
                    self.llm = self.tllm.LLM(**kw, **where)
                placement.check_worker_devices(self.llm._collective_rpc("report_device_id"), self.group_uuids)
            except BaseException as err:
                self.close()
                line = placement.start_failure(err)
                if line:
                    raise RuntimeError(line) from err
                raise
            atexit.register(self.close)      # with TLLM_RAY_FORCE_LOCAL_CLUSTER=1 the LLM's Ray goes with it
        self._on_leader(start)

    def _node_placement(self, llm_args) -> dict:
        """Attach the leader to the job's Ray cluster on this node and place the group's workers in
        the bundles that hold its ranks' GPUs (node_ray.py); the cluster outlives the LLM."""
        import ray  # optional dependency: TensorRT-LLM's Ray executor needs it
        key = node_ray.job_key(dict(os.environ))
        # Ray's workers start from the environment of the process that started the cluster, with
        # TensorRT-LLM's env_vars only added on top: start it without the trainer's variables.
        with placement.worker_env(None, self.tllm):
            node_ray.connect(ray, key)
        return node_ray.placement_kwargs(llm_args, node_ray.node_bundles(ray, key), self.group_ordinals)

    def _kv_fraction(self, cfg: RolloutConfig, model_dir: str) -> float | None:
        """gpu_memory_utilization as TensorRT-LLM's fraction of free memory (resources.py), the
        smallest over the TP group's GPUs, measured now; None off CUDA (the value as given)."""
        memory = resources.gpu_memory(self.device)
        share = resources.checkpoint_bytes(model_dir) // cfg.tensor_model_parallel_size
        mine = None if memory is None else resources.kv_fraction(cfg.gpu_memory_utilization, *memory, share)
        fractions = [f for f in self.comm.all_gather(mine) if f is not None]
        if not fractions:
            return None
        if self.leader and memory is not None:
            log.info("TensorRT-LLM KV cache: free_gpu_memory_fraction=%.3f, about %.2f GiB per GPU "
                     "(gpu_memory_utilization=%s of %.1f GiB)", min(fractions),
                     min(fractions) * (memory[0] - share) / 2**30, cfg.gpu_memory_utilization, memory[1] / 2**30)
        return min(fractions)

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

    def _memory(self, release: bool, tags: list[str]) -> None:
        """Release or resume memory tags: the LLM's public release(tags) / resume(tags) where its
        class has them (the 1.4 line, as verl and NeMo-RL call them), else the workers' sleep /
        wakeup through _collective_rpc, which every version read has."""
        if self.features.memory_api:
            self._on_leader(lambda: getattr(self.llm, "release" if release else "resume")(tags=list(tags)))
        else:
            self._rpc("sleep" if release else "wakeup", list(tags))

    def _idle(self) -> None:
        """Before memory is released or weights rewritten: a request still queued or running in
        TensorRT-LLM's executor (one whose caller timed out, or another client's) would compute on
        freed memory or half-written weights. wait_for_engine_idle returns once there is none."""
        if self.features.waits_for_idle:
            self._rpc("wait_for_engine_idle")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling, prompt_limit)
        # On every rank (same prompts everywhere), so a refusal stops every rank alike.
        kws = [sampling_kwargs(sampling, self.features, response_budget(sampling, len(p), self.max_len),
                               self.pad_token_id, prompt_index=i, routes=self.routes, eos=self.eos)
               for i, p in enumerate(prompts)]
        return self._on_leader(lambda: self._generate(prompts, kws, sampling))

    def _generate(self, prompts, kws, sampling: SamplingParams) -> list[list[Completion]]:
        params_cls, mode_enum = sampling_classes(self.tllm)
        if mode_enum is not None:                # 1.3's logprobs_mode takes its LogprobMode enum
            kws = [{**kw, "logprobs_mode": mode_enum(kw["logprobs_mode"])} for kw in kws]
        outputs = self.llm.generate(prompts, [params_cls(**kw) for kw in kws])
        return copy_greedy([[completion_from_output(o, self.routes) for o in out.outputs] for out in outputs],
                           sampling)

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.reloading:               # the sync's first bucket
            self._idle()
        resume = sorted(self.released - {KV_TAG})
        if resume:                           # all but the KV cache, which wakes after the refit
            self._memory(False, resume)
            self.released -= set(resume)
        self.weights.begin_bucket()
        named = [(name, t.to(self.device)) for name, t in bucket]
        parts = self.comm.gather(bucket_handles(named, self.device_uuid))
        merged = {uuid: h for part in parts for uuid, h in part.items()} if self.leader else None
        self.reloading = True                # from here TensorRT-LLM may have rewritten parameters
        try:
            self._rpc("update_weights", merged)
        except BaseException:
            self._torn()
            raise
        for name, _ in named:
            self.weights.received(name)

    def _torn(self) -> None:
        """The first bucket of a sync runs pre_reload_weights, which re-registers parameters as
        uninitialized storage (rlhf_utils.py): after any failure from there on the model is a mix
        until a full sync. Builds with abort_update_weights end the cycle on every worker."""
        self.weights.mixed()
        self.reloading = False
        if self.features.aborts_reload:
            self._rpc("abort_update_weights")

    def finalize_weights(self) -> None:
        try:
            self.weights.finalize()          # refuses (and keeps refusing generate) if a tensor is missing
            self._rpc("update_weights", None)
        except BaseException:
            self._torn()
            raise
        self.reloading = False
        self._rpc("reset_prefix_cache")      # also done by that call on the versions read; cheap to be sure

    def abort_weight_update(self) -> None:
        if self.reloading:                   # a bucket reached TensorRT-LLM: nothing old is left to keep
            self._torn()
        else:
            self.weights.abort()

    def sleep(self, on_release=None) -> None:
        """Release every memory tag (args.py `sleep_tags`). on_release(tag), called on every rank
        after each tag, releases them one at a time so a caller can measure what each frees
        (benchmarks/trtllm_check.py); without it, one call releases them all."""
        if not self.cfg_sleep:
            raise RuntimeError("this trtllm engine was built with enable_sleep_mode=false: it cannot sleep")
        if self.asleep:
            return
        tags = sleep_tags(self.features)
        self._idle()
        for part in ([[t] for t in tags] if on_release else [tags]):
            self._memory(True, part)
            self.released |= set(part)
            if on_release:
                on_release(part[0])
        if self.sleep_weights == "drop":
            self.weights.release()           # restore mode NONE: their content is gone until a full sync
        self.asleep = True

    def wake(self) -> None:
        if not self.cfg_sleep:
            raise RuntimeError("this trtllm engine was built with enable_sleep_mode=false: it cannot wake")
        if self.released:
            self._memory(False, sorted(self.released, key=lambda t: t == KV_TAG))
            self.released = set()
        # The KV blocks came back without their content (restore mode NONE) but block reuse still
        # points at them, and a wake-up without a full refit (keep-weights, validation-only cycles)
        # resets nothing inside TensorRT-LLM: forget them, or prompts sharing a prefix decode garbage.
        self._rpc("reset_prefix_cache")
        self.asleep = False

    @property
    def cfg_sleep(self) -> bool:
        return bool(self.config.enable_sleep_mode)


def build_trtllm(req: BuildRequest) -> TRTLLMEngine:
    """The engine from the rollout config (declared in megarl/engines/trtllm.py)."""
    return TRTLLMEngine(req.model_path, req.cfg, tp_group=req.tp_group, pad_token_id=pad_id(req.tokenizer),
                        device=req.device if req.device.type == "cuda" else None)
