"""The conformance fake's LLM: start-up as the Ray executor does it, the workers' RPCs, sleep by
memory tag, and generation with a real transformers model (see trtllm_fake.py for what each part
is built from). FAKE: tensorrt_llm cannot run here.
"""
from __future__ import annotations

import copy
import enum
import importlib
import json
import os
import sys
import types

import numpy as np
import torch

from tests.rollout import trtllm_fake_ipc as ipc
from tests.rollout import trtllm_fake_sampling as sampling
from tests.rollout.trtllm_fake_ray import NODE_LOCAL_VARS, NOSET, RayWorkerWrapper

KV_BYTES = 1 << 20                          # the fake KV cache's size in the ledger
EXTRA_BYTES = 1 << 16                       # each other tag's allocations (sampler, executor_extra, ...)
KV, MODEL, WEIGHTS = "kv_cache", "model", "model_weights"
ROUTE_SHAPE = (2, 2, 8)                     # the fake's MoE layers, top-k, experts (its model is dense)


class FakeCluster:
    """The node: its GPUs in CUDA's own order (a process without CUDA_VISIBLE_DEVICES sees them all),
    and which packages are installed in the Ray workers' Python (none: megarl is not pip-installed)."""
    gpus: list[str] = [f"GPU-fake-{i}" for i in range(8)]
    installed: set[str] = set()


class _LLM:
    """Stands in for tensorrt_llm.LLM (class attributes set per snapshot by `build`)."""
    snap: dict = {}
    mod: types.ModuleType = None
    instances: list = []
    started_ray = False

    def __init__(self, **kwargs):
        type(self).instances.append(self)
        self.shut = False
        # _TorchLLM.__init__ (llmapi/llm.py at 1f064c46): pop backend, refuse what TorchLlmArgs lacks,
        # then the pydantic model itself (extra="forbid") validates what is left.
        model, passed = self.mod.llmapi.llm_args.TorchLlmArgs, dict(kwargs)
        backend = kwargs.pop("backend", "pytorch")
        unsupported = [k for k in kwargs if k not in model.model_fields and k not in ("_mpi_session", "backend")]
        if unsupported:
            raise ValueError(f"The following arguments are not supported by the PyTorch backend: {unsupported}.")
        self.args = model(**kwargs, **({"backend": backend} if "backend" in model.model_fields else {}))
        self.kwargs = passed
        self.tp = kwargs.get("tensor_parallel_size", 1)
        self.sleep_modes = self._restore_modes(kwargs)
        self._start_ray()
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
        self.extra_tags = [t for t in (self.snap.get("executor_memory_types") or [])
                           if not t.startswith("_") and t not in (KV, WEIGHTS)]
        self.resident = self.weight_bytes + KV_BYTES + EXTRA_BYTES * len(self.extra_tags)
        self.peak = self.resident
        self.rpcs: list = []
        self.sent: list = []                  # every SamplingParams generate() received
        self.prefix_cache: list = []          # (prompt, its KV) that block reuse may serve again
        self.reload_latch = False             # rlhf_utils.py's first_pre_reload_weights
        self.outstanding: set[str] = set()    # parameters a torn reload cycle never rewrote

    # -- start-up, as the Ray executor does it ---------------------------------------------------
    def _start_ray(self) -> None:
        """RayExecutor.__init__ (executor/ray/executor.py at e14a6f64; trtllm_fake_ray.py for Ray's
        side): attach or start, and remember whether it "started" a cluster, which shutdown() then
        ends with ray.shutdown(). In a process already attached, ray.init returns at once: nothing
        counts as started, whatever the namespace."""
        self.ray = ray = sys.modules["ray"]      # the process's ray, as `import ray` in the executor
        args = {"include_dashboard": False, "namespace": "trtllm", "ignore_reinit_error": True}
        if os.environ.get("TLLM_RAY_FORCE_LOCAL_CLUSTER", "0") != "1":
            try:
                ray.init(address="auto", **args)
            except ConnectionError:
                pass
            if not ray.is_initialized():
                ray.init(**args)
                self.started_ray = True
        else:
            ray.init(address="local", **args)
            self.started_ray = True
        # The workers' environment: the leader's, minus Ray's node-local variables, plus the three
        # the executor sets (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES in the leader's os.environ).
        self.worker_env = {k: v for k, v in os.environ.items() if k not in NODE_LOCAL_VARS}
        self.worker_env.update({"TLLM_DISABLE_MPI": "1", "MASTER_ADDR": "127.0.0.1", NOSET: "1"})

    def _start_workers(self, extension: str | None) -> list[str]:
        """Ray started here sees the GPUs CUDA_VISIBLE_DEVICES names (all of them without it); worker
        r takes Ray GPU slot r; RayWorkerWrapper does int(ray.get_gpu_ids()[0]) (Ray returns the
        entry of the worker's inherited CUDA_VISIBLE_DEVICES) and maps it back through that list
        parsed as integers; the worker then runs on that physical GPU."""
        placed = self.kwargs.get("ray_placement_config")
        if placed is not None and getattr(placed, "placement_groups", None) is not None:
            return self._start_placed_workers(placed, extension)
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

    def _start_placed_workers(self, placed, extension: str | None) -> list[str]:
        """RayExecutor._get_placement_group and create_workers (executor.py at e14a6f64): the bundle
        indices must add up to the world size; rank r is a RayWorkerWrapper actor with
        num_gpus=per_worker_gpu_share (else TRTLLM_RAY_PER_WORKER_GPUS, 1.0) in bundle r of its group,
        through PlacementGroupSchedulingStrategy, with the workers' environment."""
        total = sum(len(i) for i in placed.placement_bundle_indices)
        if total != self.tp:
            raise ValueError(f"Total bundle indices ({total}) must equal world_size ({self.tp})")
        share = placed.per_worker_gpu_share or float(os.environ.get("TRTLLM_RAY_PER_WORKER_GPUS", "1.0"))
        flat = [(pg, i) for pg, indices in zip(placed.placement_groups, placed.placement_bundle_indices)
                for i in indices]
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        self.ray_workers = [self.ray.remote(RayWorkerWrapper).options(
            num_gpus=share, runtime_env={"env_vars": self.worker_env},
            scheduling_strategy=strategies.PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)).remote(rank)
            for rank, (pg, i) in enumerate(flat)]
        if extension:
            self._import_extension(extension)
        self.effective_env = self.ray.get(self.ray_workers[0].environment.remote())
        return [FakeCluster.gpus[g] for g in self.ray.get([w.device.remote() for w in self.ray_workers])]

    # RayGPUWorker's own class attributes (executor/ray/gpu_worker.py at 00be09f7; its bases'
    # were not read): RayWorkerWrapper._inject_worker_extension refuses an extension defining one.
    WORKER_ATTRS = ("enqueue_request", "setup_engine", "sleep", "wakeup", "start", "shutdown",
                    "_get_comm_ranks_device_id")

    @classmethod
    def _import_extension(cls, qualname: str) -> None:
        top = qualname.split(".")[0]
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if top not in FakeCluster.installed and not any(os.path.isdir(os.path.join(p, top)) for p in paths):
            raise RuntimeError("RayGPUWorker died during initialization") from RuntimeError(
                f"Failed to load worker extension '{qualname}'")
        module, name = qualname.rsplit(".", 1)
        extension = getattr(importlib.import_module(module), name)
        for attr in dir(extension):
            if not attr.startswith("__") and attr in cls.WORKER_ATTRS:
                raise ValueError(f"Worker class RayGPUWorker already defines '{attr}', which conflicts with "
                                 f"extension {extension.__name__}.")

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
        if tag in (KV, self.weight_tag):
            return KV_BYTES if tag == KV else self.weight_bytes + (EXTRA_BYTES if tag == MODEL else 0)
        return EXTRA_BYTES if tag in self.extra_tags else 0

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
        # Methods the snapshot's WorkerExtension has. abort_update_weights (main, index excerpt) clears
        # the latch and keeps the coverage debt; wait_for_engine_idle returns once no request is queued
        # or running, which is always so here (generate() returns when every request is done).
        local = {"reset_prefix_cache": lambda: setattr(self, "prefix_cache", []),
                 "abort_update_weights": lambda: setattr(self, "reload_latch", False),
                 "wait_for_engine_idle": lambda: None}
        if method not in local or method not in (self.snap.get("worker_methods") or []):
            raise AttributeError(f"the workers have no method {method!r}")
        local[method]()
        return [None] * len(self.workers)

    def _update_weights(self, handles):
        """WorkerExtension.update_weights (tensorrt_llm/llmapi/rlhf_utils.py). The first call of a
        sync runs every module's pre_reload_weights, which re-registers the parameters as
        uninitialized storage (NaN here, on every parameter: stricter than the modules that have
        the hook). Two cycles, by snapshot["reload_cycle"]:
          "latched" (04762f3b): the walk runs on the first call of a cycle, bucket or finalize;
              a failure leaves the latch set; finalize loads whatever arrived.
          "abortable" (main, index excerpt, no commit): the handles are checked and decoded before
              the walk (a failure there mutates nothing); a failure after it clears the latch; the
              coverage debt of a torn cycle vetoes finalize and survives abort_update_weights."""
        if self.weight_tag in self.released:
            raise RuntimeError("CUDA error: an illegal memory access (weights released, not resumed)")
        abortable = self.snap.get("reload_cycle") == "abortable"
        bucket = None
        if handles is not None and abortable:
            bucket = self._decode(handles)
        try:
            if not self.reload_latch and (handles is not None or not abortable):
                self._pre_reload()
            if handles is None:
                return self._finalize(abortable)
            self._load(bucket if bucket is not None else self._decode(handles))
        except Exception:
            if abortable:
                self.reload_latch = False
            raise
        return None

    def _pre_reload(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        self.outstanding = {n for n, _ in self.model.named_parameters()}
        self.reload_latch = True

    def _decode(self, handles) -> list:
        return ipc.decode(handles, self.workers)

    def _load(self, named) -> None:
        """model_loader.reload(model, weights, allow_partial_loading=True): a name the model does
        not have fails the bucket after the names before it were written."""
        state = dict(self.model.named_parameters())
        size = 0
        for name, tensor in named:
            if name not in state:
                raise KeyError(f"no parameter {name} in the model")
            size += tensor.numel() * tensor.element_size()
            with torch.no_grad():
                state[name].copy_(tensor)
            self.outstanding.discard(name)
        self._account(size, "bucket in")
        self._account(-size, "bucket out")

    def _finalize(self, abortable: bool):
        if abortable and self.outstanding:
            raise RuntimeError(f"weight reload cycle is torn: {len(self.outstanding)} parameter(s) never reloaded "
                               f"(first: {sorted(self.outstanding)[0]}); resend every weight")
        self.prefix_cache = []                # the finalize call resets the prefix cache (rlhf_utils.py)
        self.reload_latch = False
        return None

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == self.weight_tag and tag != MODEL:
            return list(self.model.parameters())
        if tag == MODEL:
            return list(self.model.buffers()) + (list(self.model.parameters()) if self.weight_tag == MODEL else [])
        return []

    def _sleep(self, tags):
        """RayGPUWorker.sleep (executor/ray/gpu_worker.py at a3dfe261): each tag through
        ExecutorMemoryType(tag). A tag restore_modes leaves out is copied to host memory first
        ("Unlisted entries default to the suitable mode selected between PINNED and CPU",
        SleepConfig's reference page, current docs; NONE and MEMSET copy nothing)."""
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
        ray = self.ray
        for worker in getattr(self, "ray_workers", []):
            ray.kill(worker, no_restart=True)  # a placement group it was given stays (executor.py)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()                    # RayExecutor.shutdown, whoever else uses this Ray

    # -- generation ------------------------------------------------------------------------------
    def generate(self, inputs, sampling_params=None):
        blocked = set(self.released)           # every tag holds something generation uses
        if blocked:
            raise RuntimeError(f"generate() while {sorted(blocked)} are released")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError("one SamplingParams per prompt")
        for sp in params:
            self._check_arguments(sp)
            self._setup(sp)
        self.sent.extend(params)
        return [self._one(list(p), sp) for p, sp in zip(inputs, params)]

    def _setup(self, sp) -> None:
        """SamplingParams._setup (executor/params/sampling.py at 1f064c46): every eos_token_id of
        the model's generation_config.json but end_id joins stop_token_ids, whatever ignore_eos
        says ("The eos_token_id in generation_config are really mean to stop the text generation")."""
        path = os.path.join(self.kwargs["model"], "generation_config.json")
        eos = json.load(open(path)).get("eos_token_id") if os.path.exists(path) else None
        if eos is None:
            return
        stops = list(sp.stop_token_ids or [])
        for tok in [eos] if isinstance(eos, int) else eos:
            if tok != sp.end_id and tok not in stops:
                stops.append(tok)
        sp.stop_token_ids = stops or None

    def _check_arguments(self, sp) -> None:
        """LLM._check_arguments (tensorrt_llm/llmapi/llm.py, the 1.3.0rc28 docs' module source):
        return_routed_experts on a request needs an LLM built with enable_return_routed_experts.
        The pairing is the real one; the message is ours (the text was not recorded)."""
        if getattr(sp, "return_routed_experts", False) and not self.kwargs.get("enable_return_routed_experts"):
            raise ValueError("return_routed_experts=True requires the LLM to be built with "
                             "enable_return_routed_experts=True")

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
            gen = sampling.generator(self.snap, sp.seed, j)
            toks, entries, reason = [], [], "length"
            out = self._prefill(prompt)
            for _ in range(sp.max_tokens):
                if toks:
                    out = self.model(torch.tensor([toks[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                tok, raw, processed = sampling.step(out.logits[0, -1].float(), prompt + toks, sp, gen)
                toks.append(tok)
                entries.append(sampling.logprobs_entry(self.snap, tok, raw, processed, sp))
                if sp.stop_token_ids and tok in sp.stop_token_ids and self._checks_stop_words(sp):
                    reason = "stop"
                    break
                if sp.end_id not in (None, -1) and tok == sp.end_id:
                    reason = "stop"
                    break
            # Every position the model was fed: the prompt and each sampled token but the last.
            routes = (np.asarray(sampling.routes_for(prompt + toks[:-1], *ROUTE_SHAPE))
                      if getattr(sp, "return_routed_experts", False) else None)
            if reason == "stop" and not sp.include_stop_str_in_output:
                toks, entries = toks[:-1], entries[:-1]
            extra = {"routed_experts": routes} if "routed_experts" in self.snap["completion_output_fields"] else {}
            outs.append(self.mod.CompletionOutput(index=j, token_ids=toks, finish_reason=reason,
                                                  logprobs=entries if sp.logprobs is not None else [], **extra))
        return sampling.RequestOutput(prompt_token_ids=prompt, outputs=outs[:sp.n])

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
