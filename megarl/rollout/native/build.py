"""Building the built-in engine from the rollout config (declared in megarl/engines/native.py)."""
from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.models.hf_config import read_hf_config, with_overrides
from megarl.rollout.build_args import KEY, BuildRequest, engine_options
from megarl.rollout.native import host_budget
from megarl.rollout.native.engine import NativeEngine
from megarl.rollout.native.tp import TPComm


def build_native(req: BuildRequest) -> NativeEngine:
    cfg, device = req.cfg, req.device
    comm = TPComm(req.tp_group)
    if req.tp_group is not None and comm.size != cfg.tensor_model_parallel_size:
        raise ConfigError(f"the rollout TP group has {comm.size} ranks but tensor_model_parallel_size="
                          f"{cfg.tensor_model_parallel_size}", f"{KEY}.tensor_model_parallel_size")
    # Weights that come from the trainer every step need not survive sleep (level 2).
    defaults = dict(dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs, prompt_length=cfg.prompt_length,
                    prompt_truncation=cfg.prompt_truncation, sleep_level=2 if cfg.load_format == "dummy" else 1,
                    gpu_memory_utilization=cfg.gpu_memory_utilization,
                    max_num_batched_tokens=cfg.max_num_batched_tokens, enforce_eager=bool(cfg.enforce_eager))
    held = host_budget.resident_bytes()     # before the engine's weights
    hf_config = with_overrides(read_hf_config(req.model_path), req.hf_overrides)   # the trainer's model
    engine = NativeEngine(hf_config, comm=comm, device=device, config=cfg,
                          record_routes=cfg.enable_rollout_routing_replay,
                          **engine_options(NativeEngine, defaults, req.user_kwargs, cfg.name))
    if device.type != "cuda":               # several ranks share the host: stop now if a step cannot fit
        host_budget.check_fits(engine, cfg.prompt_length or 1, cfg.response_length or 1, cfg.n,
                               int(cfg.checkpoint_engine.bucket_size_mb * 2**20), held_before=held)
    if cfg.load_format != "dummy":
        engine.load_hf_dir(req.model_path)
    return engine
