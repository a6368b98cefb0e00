"""TensorRT-LLM's LLM API as a rollout engine (`actor_rollout_ref.rollout.name=trtllm`).

    engine.py      TRTLLMEngine: megarl's rollout contract on one LLM per rollout-TP group
    args.py        the LLM and SamplingParams arguments, feature detection, completions
    comm.py        the TP group's wait and gather, CUDA-IPC bucket handles
    placement.py   where TensorRT-LLM's Ray workers run, and the extension they load
    node_ray.py    one Ray cluster per node: the placement group the TP groups share, their bundles

Nothing here imports tensorrt_llm at import time: it loads when an engine is built.
"""
from megarl.rollout.trtllm.args import (completion_from_output, detect_features, llm_kwargs,
                                        require_tensorrt_llm)
from megarl.rollout.trtllm.comm import bucket_handles, checkpoint_names
from megarl.rollout.trtllm.engine import TRTLLMEngine, build_trtllm

__all__ = ["TRTLLMEngine", "build_trtllm", "bucket_handles", "checkpoint_names", "completion_from_output",
           "detect_features", "llm_kwargs", "require_tensorrt_llm"]
