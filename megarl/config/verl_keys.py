"""verl's keys that megarl does not implement: accepted at verl's default, refused otherwise.

A verl command line or YAML carries over as written: every leaf of verl's composed
ppo_trainer.yaml / ppo_megatron_trainer.yaml (release v0.7.0, stored with all their included files
under tests/assets/verl/, and release 0.9.1, read from the installed verl package) is one of
- a megarl key (megarl implements it; megarl/experiment.py and the component configs),
- a key in megarl/config/refused.py (accepted at verl's default, an alias of a megarl key, or under a
  verl section read as megarl's, MOVED),
- a key here: its verl defaults are in verl_defaults.yaml (next to this file, written by
  `python tests/assets/verl/make_defaults.py`); at one of them the key is dropped, because the
  reason in RULES says why that default changes nothing in megarl; any other value stops the run
  with that one line, which names what to use instead.
tests/test_verl_keys.py walks every verl leaf and requires exactly one of these.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import os
from typing import Any

import yaml

from megarl.config.errors import ConfigError
from megarl.config.hydra_flags import refuse_hydra_flags, refuse_hydra_sections  # noqa: F401 (megarl/train.py and experiment.py import them here)
from megarl.config.refused import MOVED, REFUSED, RENAMED
from megarl.config.typed import all_keys, open_keys

DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "verl_defaults.yaml")
VERL_RELEASE = "v0.7.0 (f9c855f7cf04d603c9546bc01776c74806a879c1) and 0.9.1 (PyPI)"

_MEGATRON = "megarl trains with megatron-core, not FSDP"
_OFFLOAD = f"{_MEGATRON}; set the layout and offload under <role>.megatron (param_offload, optimizer_offload)"
_KERNELS = ("megarl runs megatron-core's own kernels "
            "(packed sequences via actor_rollout_ref.model.use_remove_padding); remove the key")
_MM = "megarl trains text models only (no images or video); remove the key"
_LORA = ("megarl's LoRA reads actor_rollout_ref.model.lora_rank, lora_alpha, target_modules and lora_dropout "
         "(docs/lora.md); set those instead")
_PROFILE = ("megarl has no profiler hooks; run the trainer under nsys or torch.profiler yourself (metrics.jsonl "
            "carries each step's phase timings); remove the key")
_RM_POOL = ("megarl's reward model runs on the trainer ranks' own megatron layout (reward_model.enable, "
            "reward_model.model.path), not on a pool or engine of its own; remove the key")
_RAY = ("megarl starts its ranks with torchrun or srun (launch/), not Ray actors; Ray serves only the reward "
        "pool (reward_model.*), so remove the key")
_INTERNAL = "verl fills this from other keys for its workers; megarl derives it the same way; remove the key"
_DEPRECATED_MICRO = "verl's deprecated global micro batch is not used; set the *_micro_batch_size_per_gpu key"
_ENGINE_ONLY = ("a vLLM/SGLang server setting; megarl's engines (native, trtllm, hf) run inside the training "
                "processes; remove the key")
_CHECKPOINT = ("megarl saves model, optimizer and trainer state together every trainer.save_freq steps "
               "(trainer.max_actor_ckpt_to_keep prunes them); remove the key")
_MCORE_CKPT = ("megarl reads HF safetensors through its own converter (megarl/models/convert.py) and saves megatron "
               "distributed checkpoints itself; to start from a megatron checkpoint set "
               "<role>.megatron.dist_checkpointing_path")
_PADDING = ("megarl packs or pads each micro-batch itself (packed sequences via "
            "actor_rollout_ref.model.use_remove_padding); remove the key")
_OPTIM_DTYPES = ("megarl keeps main gradients and Adam states in fp32 (megatron-core's distributed optimizer); "
                 "remove the key")
_DISTILL = ("distillation from a teacher model is not implemented; megarl trains from rewards "
            "(custom_reward_function, reward_model); remove the key")
_V1 = ("megarl has one trainer, not verl's v1/legacy choice; overlap generation with training through "
       "actor_rollout_ref.rollout.placement=disaggregated and async_training.* (max_staleness); remove the key")

_POOL = ("the rollout runs on the training ranks, or on ranks of its own: actor_rollout_ref.rollout.placement="
         "disaggregated with actor_rollout_ref.rollout.disaggregated_ranks=<GPUs>, counted in trainer.n_gpus_per_node "
         "x trainer.nnodes; remove the key")
_ENGINE = ("megarl trains with megatron-core, not verl's {} engine (model_engine={}); set the layout and offload "
           "under <role>.megatron; remove the key")

# (glob over the dotted key, why the default is harmless and what to use instead). First match wins.
RULES: list[tuple[str, str]] = [
    ("*._target_", "verl's Hydra class target; megarl builds its typed config itself; remove the key"),
    ("*.torchtitan.*", _ENGINE.format("torchtitan", "torchtitan")), ("*.veomni.*", _ENGINE.format("VeOmni", "veomni")),
    ("actor_rollout_ref.ref.optim.*", "the reference model is frozen: it has no optimizer; remove the key"),
    ("*.optim.name", "set <role>.optim.optimizer (adam or adamw) instead"),
    ("*.optim.decay_type", "set <role>.optim.lr_decay_style (constant, linear, cosine) instead"),
    ("*.optim.lr_decay_ratio", "megarl decays over all the remaining steps; set <role>.optim.lr_decay_style"),
    ("*.optim.lr_start", "megarl's warm-up starts from 0; remove the key"),
    ("*.optim.lr_min", "set <role>.optim.min_lr instead"),
    ("*.optim.min_lr_factor", "set <role>.optim.min_lr (an absolute rate) instead"),
    ("actor_rollout_ref.ref.fsdp_config.*", f"{_MEGATRON}; to offload the frozen reference's weights set "
                                            "actor_rollout_ref.ref.megatron.param_offload (it has no optimizer)"),
    ("*fsdp_config.*", _OFFLOAD), ("critic.fsdp.*", _OFFLOAD),
    ("*.strategy", "megarl trains with megatron-core only; remove the key or set megatron"),
    ("*.use_torch_compile", "megarl's roles run megatron-core's own kernels, not torch.compile; remove the key"),
    ("*profiler.*", _PROFILE), ("global_profiler.*", _PROFILE),
    ("*.lora.*", _LORA), ("*.exclude_modules", _LORA), ("*.lora_adapter_path", _LORA),
    ("*.megatron.use_dist_checkpointing", _MCORE_CKPT), ("*.megatron.dist_checkpointing_prefix", _MCORE_CKPT),
    ("*.megatron.use_mbridge", _MCORE_CKPT), ("*.megatron.vanilla_mbridge", _MCORE_CKPT),
    ("*.megatron.override_mcore_model_config", "use <role>.megatron.override_transformer_config"),
    ("*.megatron.use_megatron_fsdp", "megarl shards with megatron-core's distributed optimizer "
                                     "(<role>.megatron.use_distributed_optimizer), not Megatron-FSDP; remove the key"),
    ("*.megatron.dynamic_context_parallel", "megarl's context parallelism is fixed by the layout: set "
                                            "<role>.megatron.context_parallel_size; remove the key"),
    ("*.megatron.max_seqlen_per_dp_cp_rank", "megarl's context parallelism is fixed by the layout: set "
                                             "<role>.megatron.context_parallel_size; remove the key"),
    ("*.megatron.dist_ckpt_optim_fully_reshardable", _CHECKPOINT),
    ("*.megatron.distrib_optim_fully_reshardable_mem_efficient", _CHECKPOINT),
    ("*.megatron.pad_*", _PADDING), ("*.pad_to_length", _PADDING),
    # verl 0.9.1 moved route replay under <role>.megatron; megarl keeps verl 0.7's place (the critic has none)
    ("critic.megatron.router_replay.mode", "megarl replays routes for the actor and reference only "
                                           "(actor_rollout_ref.actor.router_replay.mode); remove the key"),
    ("*.qat.*", "quantization-aware training is not supported: megarl trains in bf16 on GPU, fp32 on CPU; "
                "remove the key"),
    ("actor_rollout_ref.rollout.qat", "quantization-aware training is not supported; remove the key"),
    ("*.mtp.*", "multi-token prediction (MTP) layers and speculative decoding are not supported; remove the key"),
    ("actor_rollout_ref.rollout.mtp", "multi-token prediction (MTP) layers and speculative decoding are not "
                                      "supported; remove the key"),
    ("*.megatron.dtype", "megarl trains in bf16 on GPU and fp32 on CPU (trainer.device); remove the key"),
    ("*.megatron.forward_only", _INTERNAL),
    ("*.megatron.use_remove_padding", "set actor_rollout_ref.model.use_remove_padding (packed sequences) instead"),
    ("reward_model.megatron.*", _RM_POOL),
    ("*.checkpoint.save_contents", "megarl saves model, optimizer and trainer state together every "
                                   "trainer.save_freq steps; for an HF copy (hf_model) convert a saved step with "
                                   "python checkpoints_tools/megatron_to_hf.py --ckpt <trainer.default_local_dir>/"
                                   "global_step_<N>/actor --out <hf dir>"),
    ("*.checkpoint.*", _CHECKPOINT),
    ("trainer.del_local_ckpt_after_load", _CHECKPOINT),
    ("trainer.default_hdfs_dir", "megarl writes to trainer.default_local_dir only; copy it to HDFS yourself"),
    ("*.optim.optimizer_impl", "megarl uses megatron-core's distributed optimizer; choose it with "
                               "<role>.optim.optimizer (adam or adamw)"),
    ("*.optim.override_optimizer_config", "set <role>.optim.* (lr, betas, eps, weight_decay, clip_grad) instead"),
    ("*.optim.warmup_style", "verl's deprecated name; megarl warms up linearly for lr_warmup_steps / "
                             "lr_warmup_steps_ratio and decays by <role>.optim.lr_decay_style"),
    ("*.optim.lr_scheduler_type", "set <role>.optim.lr_decay_style (constant, linear, cosine) instead"),
    ("*.optim.min_lr_ratio", "set <role>.optim.min_lr (an absolute rate) instead"),
    ("*.optim.num_cycles", "megarl's cosine decay runs one half cycle to <role>.optim.min_lr; remove the key"),
    ("*.optim.lr_warmup_init", "megarl's warm-up starts from 0; remove the key"),
    ("*.optim.lr_wsd_*", "warmup-stable-decay is not supported; use <role>.optim.lr_decay_style"),
    ("*.optim.muon_*", "the Muon optimizer is not supported; <role>.optim.optimizer is adam or adamw"),
    ("*.optim.use_layer_wise_distributed_optimizer", "the Muon optimizer is not supported; megarl shards Adam "
                                                     "with <role>.megatron.use_distributed_optimizer"),
    ("*.optim.use_precision_aware_optimizer", _OPTIM_DTYPES), ("*.optim.main_grads_dtype", _OPTIM_DTYPES),
    ("*.optim.exp_avg_dtype", _OPTIM_DTYPES), ("*.optim.exp_avg_sq_dtype", _OPTIM_DTYPES),
    ("*.optim.zero_indexed_step", "megarl's learning-rate schedule is set by <role>.optim.lr_warmup_steps "
                                  "and lr_decay_style; remove the key"),
    ("*.optim.weight_decay_incr_style", "megarl keeps <role>.optim.weight_decay constant; remove the key"),
    ("*.optim.use_checkpoint_opt_param_scheduler", "megarl resumes the scheduler from its own checkpoint; "
                                                   "remove the key"),
    ("*.ulysses_sequence_parallel_size", "for long sequences use <role>.megatron.context_parallel_size "
                                         "(megatron's context parallelism) instead of Ulysses"),
    ("*.use_fused_kernels", _KERNELS), ("*.fused_kernel_options.*", _KERNELS), ("*.use_liger", _KERNELS),
    ("*.entropy_checkpointing", _KERNELS), ("*.entropy_from_logits_chunk_size", _KERNELS),
    ("*.entropy_from_logits_with_chunking", _KERNELS),
    ("*.tiled_mlp.*", _KERNELS), ("*.enable_activation_offload", "use <role>.megatron.override_transformer_config "
                                                                 "(recompute_granularity) to save activation memory"),
    ("*.use_shm", "megarl reads models and data from the file system; remove the key"),
    ("actor_rollout_ref.actor.use_remove_padding", "set actor_rollout_ref.model.use_remove_padding instead"),
    ("*.load_weight", _INTERNAL), ("*.rollout_n", _INTERNAL), ("*.calculate_entropy", _INTERNAL),
    ("*.data_loader_seed", "set trainer.seed (it seeds the data order too)"),
    ("critic.shuffle", "set data.shuffle (one order for every role)"),
    ("*.nccl_timeout", "set trainer.collective_timeout_s instead"),
    ("*router_replay.record_file", "megarl carries routes in the batch (routed_experts), never through files; "
                                   "set <role>.router_replay.mode and remove the key"),
    ("*router_replay.replay_file", "megarl carries routes in the batch (routed_experts), never through files; "
                                   "set <role>.router_replay.mode and remove the key"),
    ("*.loss_scale_factor", "megarl's loss is set by <role>.loss_agg_mode; remove the key"),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared", "no megarl loss uses the sum of squared policy "
                                                         "probabilities; remove the key"),
    ("actor_rollout_ref.actor.use_prefix_grouper", "megarl trains each response with its own copy of the prompt "
                                                   "(no shared-prefix grouping); remove the key"),
    ("*.freeze_vision_tower", _MM), ("data.image_*", _MM), ("data.video_key", _MM),
    ("data.return_multi_modal_inputs", _MM), ("*.limit_images", _MM),
    ("data.audio_key", _MM), ("data.mm_processor_kwargs", _MM),
    ("*.model.custom_chat_template", "put the template in the tokenizer directory's "
                                     "tokenizer_config.json (chat_template) instead"),
    ("*.model.hf_config_path", "megarl reads config.json from <role>.model.path; remove the key"),
    ("actor_rollout_ref.rollout.agent.*", "megarl's agent loop is the multi-turn rollout "
                                          "(actor_rollout_ref.rollout.multi_turn.*) or a custom class "
                                          "(rollout.name=custom, custom_cls_path)"),
    ("*.function_tool_path", "declare tools in the file actor_rollout_ref.rollout.multi_turn.tool_config_path "
                             "names (megarl's tool functions); remove the key"),
    ("actor_rollout_ref.rollout.multi_turn.*", "megarl renders multi-turn prompts with the tokenizer's own template "
                                               "and checks tokenization itself; remove the key"),
    ("actor_rollout_ref.rollout.prometheus.*", _ENGINE_ONLY), ("actor_rollout_ref.rollout.trace.*", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.disable_log_stats", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.layered_summon", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.full_determinism", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.scheduling_policy", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.router_config_path", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.disaggregation.*", "prefill/decode disaggregation of a vLLM/SGLang server is not "
                                                   "supported; to give generation ranks of their own set "
                                                   "actor_rollout_ref.rollout.placement=disaggregated"),
    ("actor_rollout_ref.rollout.nnodes", _POOL), ("actor_rollout_ref.rollout.n_gpus_per_node", _POOL),
    ("actor_rollout_ref.rollout.checkpoint_engine.*", "choose megarl's weight transport with "
                                                      "actor_rollout_ref.rollout.checkpoint_engine.backend; "
                                                      "remove the key"),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.layer_name_map.*", _ENGINE_ONLY),
    ("actor_rollout_ref.rollout.quantization_config_file", "quantized rollout is not supported; remove the key"),
    ("actor_rollout_ref.rollout.skip_*", "rollout dumps are not supported: every step generates; remove the key"),
    ("actor_rollout_ref.rollout.logprobs_mode", "megarl's engines return log-probs of the sampling distribution; "
                                                "remove the key"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "megarl's engines always return log-probs; remove the key"),
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes",
     "set actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb instead"),
    ("algorithm.filter_groups.max_inflight_gen_batches", "megarl generates one round at a time, up to "
                                                         "algorithm.filter_groups.max_num_gen_batches; remove the key"),
    ("algorithm.pf_ppo.*", "PF-PPO reweighting is not implemented; remove the key"),
    ("algorithm.use_pf_ppo", "PF-PPO reweighting is not implemented; remove the key"),
    ("algorithm.rollout_correction.*", "this rollout-correction mode is not implemented; megarl's "
                                       "algorithm.rollout_correction keys are the supported ones"),
    ("critic.forward_micro_batch_size*", "set critic.ppo_micro_batch_size_per_gpu (also used for values) instead"),
    ("*.ppo_micro_batch_size", _DEPRECATED_MICRO), ("*.log_prob_micro_batch_size", _DEPRECATED_MICRO),
    ("data.apply_chat_template_kwargs", "megarl applies the tokenizer's template with its defaults; remove the key"),
    ("data.datagen.*", "dynamic data generation is not supported; give the rows in data.train_files"),
    ("data.sampler.*", "megarl's sampler is the resumable shuffled one (data.shuffle, trainer.seed); "
                       "remove the key"),
    ("data.filter_overlong_prompts_workers", "megarl filters overlong prompts in one pass at start; remove the key"),
    ("data.return_full_prompt", "megarl keeps each row's chat messages with the batch; remove the key"),
    ("data.return_raw_input_ids", "megarl keeps each row's chat messages with the batch; remove the key"),
    ("data.tokenizer", "set actor_rollout_ref.model.tokenizer_path instead"),
    ("data.tool_config_path", "set actor_rollout_ref.rollout.multi_turn.tool_config_path instead"),
    ("data.*_max_samples", "cut the data file instead (megarl uses every row)"),
    ("data.trust_remote_code", "set actor_rollout_ref.model.trust_remote_code instead"),
    ("data.validation_shuffle", "megarl validates on the file's order; remove the key"),
    ("ray_kwargs.*", _RAY), ("trainer.ray_wait_register_center_timeout", _RAY), ("transfer_queue.*", _RAY),
    ("trainer.use_legacy_worker_impl", _RAY),
    ("reward_manager.*", "set reward_model.reward_manager (naive, batch, or a class path) instead"),
    ("reward_model.sandbox_fusion.*", "sandboxed code execution is not built in; score code in "
                                      "custom_reward_function.path"),
    ("*sandbox_fusion.*", "sandboxed code execution is not built in; score code in custom_reward_function.path"),
    # verl 0.9.1 gathered the reward keys under reward.; megarl reads its spelling of the keys megarl has as verl
    # 0.7's names (refused.py MOVED and RENAMED)
    ("reward.reward_manager.*", "set reward_model.reward_manager to naive, batch, or a class path "
                                "(pkg.module:Class or file.py:Class) instead"),
    ("reward.reward_model.*", _RM_POOL),
    ("reward_model.*", _RM_POOL),
    ("skip.*", "rollout dumps are not supported: every step generates; remove the key"),
    ("distillation.*", _DISTILL),
    ("trainer.use_v1", _V1), ("trainer.v1.*", _V1),
    ("trainer.checkpoint_callback_class", "megarl calls nothing at save; process the step directories under "
                                          "trainer.default_local_dir after they are written; remove the key"),
    ("trainer.balance_batch", "megarl cuts micro-batches by tokens where use_dynamic_bsz is set; remove the key"),
    ("trainer.critic_warmup", "critic warm-up steps are not implemented: the actor updates from the first step; "
                              "remove the key"),
    ("trainer.esi_redundant_time", "elastic-instance saving is not supported; set trainer.save_freq"),
]


@functools.lru_cache(maxsize=1)
def verl_defaults() -> dict[str, list[Any]]:
    """dotted verl key -> the values verl's two trainer configs give it by default."""
    with open(DEFAULTS_FILE) as f:
        return yaml.safe_load(f)["keys"]


@functools.lru_cache(maxsize=1)
def _verl_sections() -> frozenset[str]:
    """Keys with keys below them. One release's leaf can be another's section (0.7.0's
    rollout.profiler.tool_config is an interpolation, 0.9.1's a mapping): a mapping there is walked."""
    return frozenset(".".join(k.split(".")[:i]) for k in verl_defaults() for i in range(1, k.count(".") + 1))


def verl_default(key: str) -> tuple[bool, Any]:
    """(True, verl's default) for a verl key megarl drops at its default, else (False, None). A `${...}`
    reference to such a key reads this: the key can hold no other value."""
    plain = [d for d in verl_defaults().get(key, []) if not (isinstance(d, str) and "${" in d)]
    return (True, plain[0]) if plain else (False, None)


# Rules that depend on the config at hand, consulted first: (glob, what in the raw config makes it apply, why).
# With LoRA the reference is the actor's frozen base, so <role>.megatron of the reference is refused there.
_LORA_ON = ("actor_rollout_ref.model.lora_rank", lambda rank: isinstance(rank, int) and rank > 0)
CONTEXT_RULES: list[tuple[str, tuple[str, Any], str]] = [
    ("actor_rollout_ref.ref.fsdp_config.*", _LORA_ON,
     f"{_MEGATRON}; with LoRA (actor_rollout_ref.model.lora_rank > 0) the reference is the actor's frozen base on "
     "the actor's ranks, offloaded with it: set actor_rollout_ref.actor.megatron.param_offload instead"),
]


def rule_for(key: str, raw: dict | None = None) -> str | None:
    """The reason for `key`, with `<role>` made the key's own role (actor_rollout_ref.actor, critic, ...);
    `raw` (the user's config) picks a CONTEXT_RULES reason where one applies."""
    why = None
    for pattern, (where, applies), text in CONTEXT_RULES if raw is not None else ():
        present, value = _lookup(raw, where)
        if fnmatch.fnmatchcase(key, pattern) and present and applies(value):
            why = text
            break
    why = why or next((why for pattern, why in RULES if fnmatch.fnmatchcase(key, pattern)), None)
    parts = key.split(".")
    role = ".".join(parts[:2]) if parts[0] == "actor_rollout_ref" else parts[0]
    return why.replace("<role>", role) if why else None


def _lookup(node: Any, dotted: str) -> tuple[bool, Any]:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _accepted(key: str, defaults: list[Any]) -> list[Any]:
    """verl's defaults, plus what a `${key}` or `${oc.select:key,fallback}` default points at."""
    out = list(defaults)
    table = verl_defaults()
    for value in defaults:
        if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
            body = value[2:-1].removeprefix("oc.select:")
            ref, _, fallback = body.partition(",")
            out += table.get(ref.strip(), [])
            if fallback:
                out.append(yaml.safe_load(fallback))
    return out


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):   # 1 is not True, 0 is not False
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == default or (value in (None, {}) and default in (None, {}))


@functools.lru_cache(maxsize=2)
def _megarl_tree(root: type) -> tuple[frozenset, frozenset, tuple]:
    """(typed leaves, typed sections, free-form mapping keys) of megarl's config class `root`
    (ExperimentConfig, passed in: megarl/experiment.py imports this module)."""
    keys = set(all_keys(root))
    sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    # A free-form key that refused.py accepts only empty (verl's actor.checkpoint) is looked into.
    free = tuple(k for k in open_keys(root) if k not in REFUSED)
    return frozenset(keys - sections), frozenset(sections), free


def megarl_implements(key: str, root: type) -> bool:
    """Whether `root` (ExperimentConfig) has `key` as a typed leaf or inside a free-form mapping."""
    leaves, _, free = _megarl_tree(root)
    if key in REFUSED and isinstance(REFUSED[key][0][0], dict):
        return False                   # looked into: its verl leaves may sit at verl's default
    if key.endswith("._target_") and key.rsplit(".", 1)[0] in free:
        return False                   # Hydra's class target of a section open to a plug-in's keys
    return key in leaves or any(key == f or key.startswith(f + ".") for f in free)


def strip_verl_keys(raw: dict, root: type) -> dict:
    """`raw` without the verl-only leaves that sit at verl's default; raise for any other value."""
    table = verl_defaults()
    _, sections, _ = _megarl_tree(root)
    refused: list[tuple[str, str]] = []      # (key, why): every one is named, not one per attempt

    def walk(node: dict, prefix: str) -> dict:
        out = {}
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if megarl_implements(key, root) and key not in sections:
                out[name] = value
            elif key in table and not (isinstance(value, dict) and value and key in _verl_sections()):
                if not any(_same(value, d) for d in _accepted(key, table[key])):
                    shown = " or ".join(repr(d) for d in table[key])
                    refused.append((key, f"{value!r} is not supported (a verl key megarl accepts only at verl's "
                                         f"default {shown}): {rule_for(key, raw)}"))
            elif isinstance(value, dict) and value:
                kept = walk(value, key)
                if kept:
                    out[name] = kept
            else:
                out[name] = value
        return out

    kept = walk(raw, "")
    if refused:
        (key, why), more = refused[0], [k for k, _ in refused[1:]]
        also = f" (also away from verl's defaults: {', '.join(more)})" if more else ""
        raise ConfigError(why + also, key)
    return kept


def hint_keys(known) -> set[str]:
    """The keys a "did you mean" may name: megarl's own (and verl's spellings megarl reads as them), never one
    that is refused away from its default or that megarl drops (a hint must lead to a key that acts)."""
    spellings = {k for src in (*MOVED, *RENAMED) for k in (src, src.rsplit(".", 1)[0])}
    return (set(known) - set(REFUSED) - set(verl_defaults())) | spellings


def same_section_hint(path: str, known) -> str | None:
    """The closest key of the same section that acts (hint_keys), judged on the last name only (a shared
    prefix such as `trainer.` would make every key of the section look alike)."""
    parent, _, leaf = path.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in hint_keys(known) if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    return siblings[match[0]] if match else None
