"""Rules the megatron roles set across config sections: the layout against the ranks and the
model, one layout for every role, mini/micro batches, token budgets. Each is a small check
that ExperimentConfig runs once when built (megarl/experiment.py RULES, MODEL_RULES);
`cfg` is the ExperimentConfig.
"""
from __future__ import annotations

import sys

from megarl.config.errors import ConfigError
from megarl.models.spec import ModelSpec, check_experts, check_window


def _layouts(cfg, critic: bool = True) -> list[tuple[str, object]]:
    out = [("actor_rollout_ref.actor", cfg.actor.megatron)]
    if critic and cfg.critic.enable:
        out.append(("critic", cfg.critic.megatron))
    return out + [("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)]


def check_layout_divides_ranks(cfg) -> None:
    """TP x PP x CP of every role divides the training ranks."""
    for role, layout in _layouts(cfg):
        tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        cp = layout.context_parallel_size
        if cfg.train_world_size % (tp * pp * cp):
            cp_text = f" x CP {cp}" if cp > 1 else ""
            minus = " minus rollout.disaggregated_ranks" if cfg.rollout.placement == "disaggregated" else ""
            raise ConfigError(
                f"TP {tp} x PP {pp}{cp_text} = {tp * pp * cp} does not divide the {cfg.train_world_size} "
                f"training ranks (trainer.nnodes x trainer.n_gpus_per_node{minus}); "
                f"so TP x PP x CP x DP cannot equal the world size: change the layout or the rank count",
                f"{role}.megatron.tensor_model_parallel_size")


def shared_layout(m) -> tuple:
    """What megatron's process-global parallel_state fixes: (TP, PP, CP, VPP, EP)."""
    return (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size,
            m.virtual_pipeline_model_parallel_size or 1, m.expert_model_parallel_size)


def check_one_layout(cfg) -> None:
    """megatron's parallel_state is process-global: every role in a process shares one layout."""
    actor_layout = shared_layout(cfg.actor.megatron)
    for role, layout in _layouts(cfg)[1:]:
        theirs = shared_layout(layout)
        if theirs != actor_layout:
            raise ConfigError(
                f"TP x PP x CP x VPP x EP {theirs} differs from the actor's {actor_layout}; roles share one "
                f"megatron layout, so {role} must use the actor's layout (remove its tensor/pipeline/context/"
                "virtual_pipeline/expert sizes)", f"{role}.megatron.tensor_model_parallel_size")


def check_train_batch(cfg) -> None:
    data, actor = cfg.data, cfg.actor
    # verl (which needs only train_batch_size >= ppo_mini_batch_size) makes the last mini-batch
    # smaller, an optimizer step over fewer samples than the others; megarl's mini-batches are equal,
    # each split evenly over the DP ranks, so the refusal says so and names the nearest divisor
    if data.train_batch_size % actor.ppo_mini_batch_size:
        size = next(d for d in range(min(actor.ppo_mini_batch_size, data.train_batch_size), 0, -1)
                    if data.train_batch_size % d == 0)
        raise ConfigError(f"data.train_batch_size={data.train_batch_size} is not a multiple of "
                          f"ppo_mini_batch_size={actor.ppo_mini_batch_size}: megarl makes every mini-batch the same "
                          "size (verl would make the last one smaller); set ppo_mini_batch_size to a divisor of "
                          f"{data.train_batch_size}, e.g. {size}", "actor_rollout_ref.actor.ppo_mini_batch_size")


def _vpp_micro(seqs: int, dp: int, pp: int) -> int | None:
    """The largest micro-batch size whose micro-batch count per mini batch is a multiple of PP."""
    return next((m for m in range(seqs // (dp * pp), 0, -1) if seqs % (m * dp * pp) == 0), None)


def _check_row_micro_batches(cfg) -> None:
    """The actor's micro batch at null (verl's default) cuts by tokens only: every pass that cuts by
    rows instead needs a row count of its own."""
    ro, ref, crit, actor = cfg.rollout, cfg.actor_rollout_ref.ref, cfg.critic, cfg.actor
    if actor.ppo_micro_batch_size_per_gpu is not None:
        return
    passes = [("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", ro.log_prob_use_dynamic_bsz,
               actor.log_prob_micro_batch_size_per_gpu, "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu"),
              ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", ref.log_prob_use_dynamic_bsz,
               ref.log_prob_micro_batch_size_per_gpu, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")]
    if crit.enable:
        passes.append(("critic.use_dynamic_bsz", crit.use_dynamic_bsz, crit.ppo_micro_batch_size_per_gpu,
                       "critic.ppo_micro_batch_size_per_gpu"))
    for switch, dynamic, micro, micro_key in passes:
        if not dynamic and micro is None:
            raise ConfigError(f"{switch}=false cuts by rows, but actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu "
                              f"is null (token budgets only); set {switch}=true or {micro_key}", micro_key)


def check_mini_batches(cfg) -> None:
    """A mini batch splits into whole micro-batches over DP (a multiple of PP under VPP)."""
    _check_row_micro_batches(cfg)
    actor, crit, n, dp = cfg.actor, cfg.critic, cfg.rollout.n, cfg.data_parallel_size()
    for role, sec in (("actor_rollout_ref.actor", actor), ("critic", crit)):
        if role == "critic" and not crit.enable:
            continue
        mini, micro = sec.ppo_mini_batch_size, sec.ppo_micro_batch_size_per_gpu
        seqs = mini * n
        # token budgets (use_dynamic_bsz) cut micro-batches by tokens, whatever the row count says (as
        # in verl and megarl's update): the mini batch need only split over DP
        if micro is None or sec.use_dynamic_bsz:
            micro = 1
        if seqs % (micro * dp):
            raise ConfigError(
                f"a mini batch holds ppo_mini_batch_size x rollout.n = {mini} x {n} = {seqs} sequences, "
                f"not divisible by ppo_micro_batch_size_per_gpu x DP = {micro} x {dp}; change one of them",
                f"{role}.ppo_micro_batch_size_per_gpu")
        vpp, pp = sec.megatron.virtual_pipeline_model_parallel_size or 1, sec.megatron.pipeline_model_parallel_size
        if vpp > 1 and (seqs // (micro * dp)) % pp:
            raise ConfigError(
                f"under virtual pipeline (VPP {vpp}) megatron's interleaved schedule needs the micro-batches "
                f"per mini batch, {seqs} / (micro {micro} x DP {dp}) = {seqs // (micro * dp)}, to be a multiple "
                f"of PP {pp}; e.g. ppo_micro_batch_size_per_gpu={_vpp_micro(seqs, dp, pp) or 'smaller'}",
                f"{role}.ppo_micro_batch_size_per_gpu")


def check_token_budgets(cfg) -> None:
    """Token-budget micro-batches: packed under PP, not under VPP, each budget fits a sequence."""
    budgets, ro, m = cfg.token_budgets(), cfg.rollout, cfg.actor.megatron
    if budgets and m.pipeline_model_parallel_size > 1 and not (
            cfg.model.use_remove_padding and cfg.critic.model.use_remove_padding):
        raise ConfigError("token-budget micro-batches under pipeline parallelism need packed sequences (padded "
                          "ones of different row counts cannot share the pipeline's fixed shape); set it to true "
                          "or turn off use_dynamic_bsz", "actor_rollout_ref.model.use_remove_padding")
    vpp = m.virtual_pipeline_model_parallel_size or 1
    if budgets and vpp > 1:
        raise ConfigError(f"token-budget micro-batches vary in count, but the interleaved schedule (VPP {vpp}) "
                          "needs a multiple of PP; turn off use_dynamic_bsz or virtual pipelining",
                          "actor_rollout_ref.actor.use_dynamic_bsz")
    longest = ro.prompt_length + ro.response_length
    for key, budget in budgets:
        if budget < longest:
            raise ConfigError(f"a token budget of {budget} is smaller than the longest sequence, prompt_length "
                              f"{ro.prompt_length} + response_length {ro.response_length} = {longest}; raise it to "
                              f"at least {longest}", key)


# -- rules that need the model's HF config.json ---------------------------------------------------
def check_model_layout(cfg, hf_config: dict) -> None:
    """Every role's TP divides the heads, PP (x VPP) the layers."""
    heads = hf_config.get("num_attention_heads")
    kv = hf_config.get("num_key_value_heads") or heads
    layers = hf_config.get("num_hidden_layers")
    for role, layout in _model_layouts(cfg):
        tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        if heads % tp or kv % tp:
            raise ConfigError(f"TP {tp} must divide the model's {heads} attention heads and {kv} KV groups; "
                              f"use a TP that divides {kv}", f"{role}.megatron.tensor_model_parallel_size")
        if layers % pp:
            raise ConfigError(f"PP {pp} must divide the model's {layers} layers; use a divisor of {layers}",
                              f"{role}.megatron.pipeline_model_parallel_size")
        vpp = layout.virtual_pipeline_model_parallel_size
        if vpp and vpp > 1 and layers % (pp * vpp):
            fits = [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
            raise ConfigError(f"the model's {layers} layers do not split into PP {pp} x VPP {vpp} equal chunks; "
                              f"pick a VPP with PP x VPP dividing {layers} "
                              f"({'e.g. ' + str(fits[0]) if fits else 'here: null'})",
                              f"{role}.megatron.virtual_pipeline_model_parallel_size")


def _model_layouts(cfg) -> list[tuple[str, object]]:
    out = [("actor_rollout_ref.actor", cfg.actor.megatron),
           ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)]
    return out + ([("critic", cfg.critic.megatron)] if cfg.critic.enable else [])


def check_model_spec(cfg, hf_config: dict) -> None:
    """Expert-parallel layouts (MoE) and Mistral's sliding window, judged on megarl's ModelSpec."""
    try:
        spec = ModelSpec.from_hf_config(hf_config)
    except ValueError:
        return                             # the workers refuse the model itself, with its reason
    for role, layout in _model_layouts(cfg):
        tp, pp, ep = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                      layout.expert_model_parallel_size)
        try:
            check_experts(spec, tp, pp, ep, layout.expert_tensor_parallel_size, cfg.train_world_size)
        except ValueError as err:
            raise ConfigError(str(err), f"{role}.megatron.expert_model_parallel_size") from None
        # megatron's MoE layer refuses to train under TP without SP: each TP rank's copy of a
        # token would reach the experts (the reference only runs forward, which is exact).
        if spec.is_moe and (layout.context_parallel_size > 1 or (layout.virtual_pipeline_model_parallel_size or 1) > 1):
            raise ConfigError("MoE models are not supported with context parallelism or a virtual pipeline yet "
                              "(neither is tested with megatron's MoE layer here); set context_parallel_size=1 "
                              "and virtual_pipeline_model_parallel_size=null", f"{role}.megatron.context_parallel_size")
        if spec.is_moe and tp > 1 and not layout.sequence_parallel_on and role != "actor_rollout_ref.ref":
            raise ConfigError(f"a MoE model trains at TP {tp} > 1 only with sequence parallelism (megatron's "
                              "rule): set sequence_parallel=true (or null), or tensor_model_parallel_size=1",
                              f"{role}.megatron.sequence_parallel")
    ro, data = cfg.rollout, cfg.data
    longest = max((ro.prompt_length or data.max_prompt_length) + (ro.response_length or data.max_response_length),
                  data.max_prompt_length + data.max_response_length)
    try:
        check_window(spec, longest)
    except ValueError as err:
        raise ConfigError(str(err), "data.max_response_length") from None


# -- routing replay (MoE): actor_rollout_ref.{actor,ref}.router_replay.mode -----------------------
def check_routing_replay(cfg) -> None:
    """R3 replays the rollout's routes (only R3 reads them); the reference replays only what the
    actor's R3 puts in the batch. Whether the engine records them is its own declaration
    (megarl/engines/, checked by rollout/config.py check_engine_asks)."""
    mode, ro = cfg.actor.router_replay.mode, cfg.rollout
    records = ro.enable_rollout_routing_replay
    if mode == "R3" and not records:
        raise ConfigError("R3 replays the routes the rollout engine records; set "
                          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true (or use mode=R2)",
                          "actor_rollout_ref.actor.router_replay.mode")
    if records and mode != "R3":
        raise ConfigError(f"the rollout would record routes that nothing replays (actor router_replay.mode={mode}); "
                          "set actor_rollout_ref.actor.router_replay.mode=R3 or remove the key",
                          "actor_rollout_ref.rollout.enable_rollout_routing_replay")
    if cfg.actor_rollout_ref.ref.router_replay.mode == "R3" and mode != "R3":
        raise ConfigError("the reference replays the rollout's routes only under the actor's R3; set "
                          "actor_rollout_ref.actor.router_replay.mode=R3 or the reference's to disabled",
                          "actor_rollout_ref.ref.router_replay.mode")


def check_routing_replay_model(cfg, hf_config: dict) -> None:
    """Routing replay needs a mixture-of-experts model."""
    on = [role for role, sec in (("actor_rollout_ref.actor", cfg.actor), ("actor_rollout_ref.ref",
                                                                          cfg.actor_rollout_ref.ref))
          if sec.router_replay.mode != "disabled"]
    if not on:
        return
    try:
        spec = ModelSpec.from_hf_config(hf_config)
    except ValueError:
        return                             # the workers refuse the model itself, with its reason
    if not spec.is_moe:
        raise ConfigError(f"routing replay needs a mixture-of-experts model, and {spec.architecture} is dense; "
                          "set router_replay.mode=disabled", f"{on[0]}.router_replay.mode")


# A model above this many parameters is refused on CPU unless trainer.allow_large_model_on_cpu says
# so. CPU training holds 16 bytes per parameter in fp32 (weights, gradients, Adam's two moments:
# 48 GB at 3B) and runs at roughly a TFLOP/s per host: 6 x 3e9 FLOP per token puts one GSM8K step of
# 1,280 responses of ~1,000 tokens at hours. Nobody trains that on CPU on purpose.
CPU_MAX_PARAMS = 3_000_000_000


def check_model_on_cpu(cfg, hf_config: dict) -> None:
    """A large model with trainer.device resolving to CPU is a launch without GPUs (an sbatch with
    no --gpus-per-node, device auto on a login node): refuse it before anything loads the weights."""
    tr = cfg.trainer
    if tr.allow_large_model_on_cpu or tr.device == "cuda":
        return
    if tr.device == "auto":
        # What auto means is known where torch is loaded (the preflight's device check, the ranks);
        # a config read before that, torch-free, leaves it to them.
        torch = sys.modules.get("torch")
        if torch is None or torch.cuda.is_available():
            return
    try:
        count = ModelSpec.from_hf_config(hf_config).num_parameters()
    except ValueError:
        return                             # the workers refuse the model itself, with its reason
    if count > CPU_MAX_PARAMS:
        why = "is cpu" if tr.device == "cpu" else "is auto and this machine has no usable GPU"
        raise ConfigError(f"{why}, and the model has {count / 1e9:.1f}B parameters (over "
                          f"{CPU_MAX_PARAMS / 1e9:.0f}B, which CPU training cannot carry: fp32 weights, "
                          "gradients and Adam need 16 bytes each); set trainer.device=cuda and launch with GPUs "
                          "(sbatch --gpus-per-node), or trainer.allow_large_model_on_cpu=true to train on CPU anyway",
                          "trainer.device")
