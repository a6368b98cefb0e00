"""TensorRT-LLM's LLM API, PyTorch backend (megarl/rollout/trtllm/engine.py): NVIDIA GPUs only."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="trtllm", summary="TensorRT-LLM on NVIDIA GPUs", build="megarl.rollout.trtllm.engine:build_trtllm",
    requires="tensorrt_llm", suggested=True, devices=("cuda",),
    why_no_routes="TensorRT-LLM's LLM API (1.3, megarl's supported line) returns no routed experts: CompletionOutput "
                  "has no routing field and its Qwen3-MoE keeps the top-k inside the fused MoE op (docs/trtllm.md)",
    # It captures graphs itself, configured by its own argument rather than enforce_eager.
    graphs_hint="for TensorRT-LLM set engine_kwargs.trtllm.cuda_graph_config",
)
