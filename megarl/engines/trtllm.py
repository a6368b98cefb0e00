"""TensorRT-LLM's LLM API, PyTorch backend (megarl/rollout/trtllm/engine.py): NVIDIA GPUs only."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="trtllm", summary="TensorRT-LLM on NVIDIA GPUs", build="megarl.rollout.trtllm.engine:build_trtllm",
    requires="tensorrt_llm", suggested=True, devices=("cuda",),
    # Routed experts from 1.3.0rc29's classes (PR #18397). An installed build without them is
    # refused in one line where the engine starts: only the installed classes can tell.
    records_routes=True,
    # Its Ray executor, with TLLM_RAY_FORCE_LOCAL_CLUSTER=1: ray.init(address="local") in the
    # leader's process, ray.shutdown() in LLM.shutdown(). Without it the leader joins the job's
    # node cluster, megarl's own (docs/trtllm.md, Ray in the leader's process).
    owns_process_ray=True, process_ray_switch="TLLM_RAY_FORCE_LOCAL_CLUSTER",
    # It captures graphs itself, configured by its own argument rather than enforce_eager.
    graphs_hint="for TensorRT-LLM set engine_kwargs.trtllm.cuda_graph_config",
)
