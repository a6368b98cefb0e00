"""Rules the rollout side sets across config sections: where the engine runs
(rollout.placement) and what each placement supports, its TP, its lengths. Each is a small
check that ExperimentConfig runs once when built (megarl/experiment.py RULES,
MODEL_RULES); `cfg` is the ExperimentConfig.
"""
from __future__ import annotations

import math
import os

from megarl.transports import (KEY, check_transport, chosen, delta_problem, placement_problem,
                                             unread_options)
from megarl.config.errors import ConfigError
from megarl.engines import config_info, declaring, default_name
from megarl.models.hf_config import hf_overrides
from megarl.rollout.config import codec_problem


def _disaggregated(cfg) -> bool:
    return cfg.rollout.placement == "disaggregated"


def check_engine_ranks(cfg) -> None:
    ro, tr = cfg.rollout, cfg.trainer
    if _disaggregated(cfg) and ro.disaggregated_ranks >= tr.world_size:
        raise ConfigError(f"gives all {tr.world_size} ranks to the engine; leave some for training or "
                          "raise trainer.n_gpus_per_node", "actor_rollout_ref.rollout.disaggregated_ranks")


def check_disaggregated_layout(cfg) -> None:
    """The disaggregated weight sync addresses trainer ranks by TP x PP x DP only."""
    m = cfg.actor.megatron
    if _disaggregated(cfg) and (m.context_parallel_size > 1 or (m.virtual_pipeline_model_parallel_size or 1) > 1):
        raise ConfigError("the disaggregated weight sync addresses trainer ranks by TP x PP x DP only; use "
                          "context_parallel_size=1 and virtual_pipeline_model_parallel_size=null with it, or "
                          "placement=colocated", "actor_rollout_ref.rollout.placement")


def check_process_ray(cfg) -> None:
    """An engine that runs Ray inside the rank's process (TensorRT-LLM) cannot share it with megarl's
    Ray pools: Ray allows one instance per process, and the engine would shut it down with itself."""
    info = config_info(cfg.rollout.name)
    switch = info.process_ray_switch if info is not None else ""
    if info is None or not info.owns_process_ray or (switch and os.environ.get(switch) != "1"):
        return
    fix = (f"; rollout.name={cfg.rollout.name} runs Ray inside the rank's process and shuts it down with its engine"
           + (f" under {switch}=1 (unset that variable to share the job's node cluster)" if switch else ""))
    if cfg.reward_model.launch_reward_fn_async:
        raise ConfigError(f"true scores in a Ray pool in the same process{fix}: set it to false (rewards in "
                          "process)", "reward_model.launch_reward_fn_async")
    if cfg.rollout.multi_turn.tool_backend == "ray":
        raise ConfigError(f"ray runs tools in a Ray pool in the same process{fix}: use tool_backend=thread",
                          "actor_rollout_ref.rollout.multi_turn.tool_backend")


def check_engine_overrides(cfg, info=None) -> None:
    """model.override_config changes the trainer's model; an engine that cannot take it (declared:
    EngineInfo.takes_hf_overrides) would sample from the checkpoint's config.json instead. A user's
    class is checked where preflight loads it (`info`, what the class declares)."""
    info = info or config_info(cfg.rollout.name)
    problem = info.overrides_refusal(sorted(hf_overrides(cfg.model.override_config))) if info else ""
    if problem:
        raise ConfigError(problem, "actor_rollout_ref.model.override_config")


def check_engine_trust_remote_code(cfg) -> None:
    """trust_remote_code runs the model directory's Python as this user; megarl's own key decides it.
    An engine's kwargs (vLLM's EngineArgs, TensorRT-LLM's LlmArgs, a user's class) that turn it on
    behind a false model.trust_remote_code would run that code although the config says not to."""
    if cfg.model.trust_remote_code:
        return
    for name, kwargs in sorted((cfg.rollout.engine_kwargs or {}).items()):
        if isinstance(kwargs, dict) and kwargs.get("trust_remote_code"):
            raise ConfigError("=true runs the model directory's code while actor_rollout_ref.model.trust_remote_code "
                              "is false: megarl's key decides it; remove it here, and set "
                              "actor_rollout_ref.model.trust_remote_code=true only for a model you trust",
                              f"actor_rollout_ref.rollout.engine_kwargs.{name}.trust_remote_code")


def check_async_loop_features(cfg) -> None:
    """The async loop (megarl/trainer/stream/fit.py) hands whole batches over; these need the
    engine inside the trainer's step."""
    if not _disaggregated(cfg):
        return
    if cfg.algorithm.adv_estimator == "remax":    # the one built-in estimator that takes reward_baselines
        raise ConfigError("remax is not supported with rollout.placement=disaggregated (its greedy baseline "
                          "rollout runs inside the colocated loop's step); use placement=colocated or another "
                          "estimator (grpo, rloo)", "algorithm.adv_estimator")
    offload = "offload frees device memory for a colocated engine; the trainer ranks host none"
    for on, key, why in ((cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable",
                          "dynamic sampling regenerates inside the trainer's step"),
                         (cfg.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable",
                          "multi-turn rollouts are not wired into the rollout ranks' loop yet"),
                         (cfg.reward_model.enable, "reward_model.enable",
                          "a model reward runs on the trainer ranks' megatron layout, not wired here yet"),
                         *((getattr(role.megatron, k), f"{name}.megatron.{k}", offload)
                           for name, role in (("actor_rollout_ref.actor", cfg.actor), ("critic", cfg.critic))
                           for k in ("param_offload", "grad_offload", "optimizer_offload"))):
        if on:
            raise ConfigError(f"is not supported with rollout.placement=disaggregated ({why}); set it "
                              "to false or use placement=colocated", key)


def check_sync_backend(cfg) -> None:
    """The transport serves this placement, and its own rules hold (megarl/transports/)."""
    check_transport(cfg)
    ce = cfg.rollout.checkpoint_engine
    entry = chosen(ce.backend, cfg.rollout.placement)
    problem = placement_problem(entry, cfg.rollout.placement)
    if problem:
        raise ConfigError(problem, f"{KEY}.backend")
    problem = unread_options(entry, ce.engine_kwargs)
    if problem:
        raise ConfigError(problem, f"{KEY}.engine_kwargs")
    for check in entry.checks:
        check(cfg)


def check_delta_sync(cfg) -> None:
    """delta=on needs a transport that sends deltas (the registry says which do)."""
    ce = cfg.rollout.checkpoint_engine
    problem = delta_problem(chosen(ce.backend, cfg.rollout.placement), cfg.rollout.placement)
    if ce.delta == "on" and problem:
        raise ConfigError(problem, f"{KEY}.delta")
    problem = codec_problem(ce.delta_compression)
    if problem:
        raise ConfigError(f"={ce.delta_compression}: {problem}",
                          "actor_rollout_ref.rollout.checkpoint_engine.delta_compression")


def check_disaggregated_only_keys(cfg) -> None:
    if _disaggregated(cfg):
        return
    if cfg.rollout.checkpoint_engine.keep_previous_weights is not None:
        raise ConfigError("applies to the distributed transport (placement=disaggregated) only; remove it",
                          "actor_rollout_ref.rollout.checkpoint_engine.keep_previous_weights")
    if cfg.async_training.partial_rollout:
        raise ConfigError("=true needs a rollout beside training and the colocated loop is synchronous; set "
                          "actor_rollout_ref.rollout.placement=disaggregated or remove it",
                          "async_training.partial_rollout")


def check_kv_after_update(cfg) -> None:
    """kv_after_update=keep needs an engine that declares updates landing inside its call
    (megarl/engines/); every other engine's call ends at an update, so the key would do nothing."""
    if cfg.async_training.kv_after_update != "keep":
        return
    info = config_info(cfg.rollout.name)
    if info is None or not info.updates_inside_call:
        able = " or ".join(f"rollout.name={name}" for name in declaring("updates_inside_call"))
        raise ConfigError(f"=keep needs an engine that an update can land inside ({able}); the "
                          f"{cfg.rollout.name} engine's call ends at each update; set kv_after_update=recompute",
                          "async_training.kv_after_update")


def check_partial_rollout_room(cfg) -> None:
    """A partial rollout resumes a response as prompt + its tokens so far (megarl/rollout/partial.py):
    the engine's prompt length must hold both, or a long response stops the run mid-step."""
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.async_training.partial_rollout and cfg.rollout.prompt_length < need:
        raise ConfigError(f"{cfg.rollout.prompt_length} tokens cannot hold a resumed chunk's prompt "
                          f"(data.max_prompt_length + data.max_response_length = {need}) with "
                          f"async_training.partial_rollout=true; set it to {need} or leave it unset",
                          "actor_rollout_ref.rollout.prompt_length")


def check_rollout_tp(cfg) -> None:
    ro = cfg.rollout
    rollout_ranks = ro.disaggregated_ranks if _disaggregated(cfg) else cfg.trainer.world_size
    if rollout_ranks % ro.tensor_model_parallel_size:
        raise ConfigError(f"rollout TP {ro.tensor_model_parallel_size} does not divide the {rollout_ranks} "
                          "rollout ranks; pick a divisor", "actor_rollout_ref.rollout.tensor_model_parallel_size")


def check_max_model_len(cfg) -> None:
    ro = cfg.rollout
    if ro.max_model_len is not None and ro.prompt_length + ro.response_length > ro.max_model_len:
        raise ConfigError(f"{ro.max_model_len} is less than prompt {ro.prompt_length} + response "
                          f"{ro.response_length} tokens; raise it or lower data.max_prompt_length / "
                          "data.max_response_length", "actor_rollout_ref.rollout.max_model_len")


# -- rules that need the model's HF config.json ---------------------------------------------------
def check_model_positions(cfg, hf_config: dict) -> None:
    positions = hf_config.get("max_position_embeddings")
    ro = cfg.rollout
    if positions and ro.prompt_length + ro.response_length > positions:
        room = positions - ro.prompt_length
        fix = (f"lower data.max_response_length to at most {room}" if room >= 1 else
               f"lower data.max_prompt_length below {positions} and leave room for a response")
        raise ConfigError(f"prompt {ro.prompt_length} + response {ro.response_length} tokens = "
                          f"{ro.prompt_length + ro.response_length} exceed the model's {positions} positions "
                          f"(max_position_embeddings); {fix}", "data.max_response_length")


def check_model_rollout_tp(cfg, hf_config: dict) -> None:
    heads = hf_config.get("num_attention_heads")
    kv = hf_config.get("num_key_value_heads") or heads
    rtp = cfg.rollout.tensor_model_parallel_size
    # Above the KV heads each rank holds KV head rank * kv // rtp, replicated rtp // kv times: the
    # rule of vLLM's QKVParallelLinear and TensorRT-LLM's duplicate_kv_weight (and the built-in
    # engine's ShardPlan), which need one of the two to divide the other.
    if heads % rtp or (kv % rtp if kv >= rtp else rtp % kv):
        raise ConfigError(f"rollout TP {rtp} must divide the model's {heads} attention heads, and divide or be a "
                          f"multiple of its {kv} KV heads (each rank then holds a replica of one); use a TP that "
                          f"divides {math.gcd(heads, kv)} or a multiple of {kv} that divides {heads}",
                          "actor_rollout_ref.rollout.tensor_model_parallel_size")


def check_model_head_dim(cfg, hf_config: dict) -> None:
    """An engine whose attention kernels take only large heads (declared: EngineInfo.min_head_dim)."""
    info = config_info(cfg.rollout.name)
    heads, hidden = hf_config.get("num_attention_heads"), hf_config.get("hidden_size")
    size = hf_config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if info is not None and info.min_head_dim and size is not None and size < info.min_head_dim:
        raise ConfigError(f"={info.name} ({info.summary}) takes attention head sizes of {info.min_head_dim} or more; "
                          f"this model's is {size} (hidden_size {hidden} / num_attention_heads {heads}): use a model "
                          f"with larger heads (as configs/quickstart_vllm.yaml does) or rollout.name={default_name()}",
                          "actor_rollout_ref.rollout.name")
