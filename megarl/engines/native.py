"""The built-in engine (megarl/rollout/native): any device, MoE routes, the trainer's log-probs at fp32."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="native", summary="built in, any device", title="built-in engine",
    build="megarl.rollout.native.build:build_native", requires="megarl.rollout.native", default=True, suggested=True,
    records_routes=True,                      # native/routes.py
    # fp32 on both sides: the same log_softmax(logits / T) to ~1e-5 (tests/test_bypass.py); bf16 and
    # fp16 kernels round differently from megatron's (gaps ~1e-2).
    exact_logprob_dtypes=("float32",),
    captures_cuda_graphs=True,                # native/engine.py: decode steps in CUDA graphs unless eager
    takes_hf_overrides=True,                  # model.override_config reaches its model (rollout/build_args.py)
    updates_inside_call=True,                 # native/scheduler.py: weight loads and joins inside a call
)
