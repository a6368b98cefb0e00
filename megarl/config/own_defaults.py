"""megarl's defaults where they differ from verl 0.9.1's (verl/trainer/config/_generated_ppo_megatron_trainer.yaml),
each with its reason; a run says once at start which of them it uses (`own_defaults_note`).

    note = own_defaults_note(cfg)     # None, or one line naming each key left at a megarl default

tests/test_config_defaults.py compares megarl's defaults with that installed tree: every difference is in
one of the three tables below, and every entry still differs.
"""
from __future__ import annotations

from typing import Any

VERL_TREE = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml (verl 0.9.1)"

# verl's example values, which every run sets (paths, names, sizes of its gsm8k example); no note.
EXAMPLES = ("data.train_files", "data.val_files", "data.train_batch_size", "actor_rollout_ref.model.path",
            "critic.model.path", "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.name",
            "actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.project_name",
            "trainer.experiment_name", "trainer.n_gpus_per_node", "trainer.logger")

# megarl's value means what verl's does where verl's applies (a null that resolves to it, or a key megarl
# accepts at both values); no note. key -> how.
SAME = {
    "actor_rollout_ref.actor.clip_ratio_low": "null: clip_ratio, 0.2 as verl's",
    "actor_rollout_ref.actor.clip_ratio_high": "null: clip_ratio, 0.2 as verl's",
    **{f"{role}.megatron.sequence_parallel": "null: on exactly where TP > 1 (verl's true is off at TP 1 too)"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    **{f"{role}.megatron.use_distributed_optimizer": "null: on with CUDA, as verl's true; CPU has none"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    "actor_rollout_ref.actor.optim.optimizer": "megatron's adam is AdamW (decoupled weight decay): the same update",
    "critic.optim.optimizer": "megatron's adam is AdamW (decoupled weight decay): the same update",
    "actor_rollout_ref.rollout.mode": "both values wait for every generation of a step (refused.py ALREADY)",
    "actor_rollout_ref.rollout.dtype": "auto: bf16 on GPU, verl's; fp32 on CPU, where bf16 has no fast kernels",
    "actor_rollout_ref.rollout.enforce_eager": "null: the engine's own choice, eager where no CUDA graphs exist",
    "actor_rollout_ref.rollout.checkpoint_engine.backend": "auto: the transport the placement needs",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": "null: bucket_size_mb's value",
    "critic.enable": "null in verl, resolved here: on exactly when the advantage estimator needs values",
    "reward_model.enable": "verl 0.9.1's null reads reward.reward_model.enable, false",
    "reward_model.reward_manager": "verl 0.9.1's null reads reward.reward_manager.name, naive",
    "custom_reward_function.name": "verl 0.9.1's null reads reward.custom_reward_function.name, compute_score",
    "algorithm.rollout_correction.bypass_mode":
        "null: on only where it changes nothing (megarl/trainer/loop/bypass.py)",
    "trainer.device": "auto: cuda where there is one, verl's; cpu otherwise",
    "data.dataloader_num_workers": "megarl tokenizes the data once at start; no loader workers either way",
    "data.return_raw_chat": "megarl keeps each row's chat at both values (refused.py ALREADY)",
    "data.seed": "verl's null shuffles with torch's fixed built-in seed; megarl's fixed default is 1: both repeat",
}

# megarl's own choices, named once at start when a run leaves them at megarl's default: key -> (verl's, why).
OWN: dict[str, tuple[Any, str]] = {
    "data.filter_overlong_prompts": (False, "prompts over max_prompt_length are dropped and counted, not fatal"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (True, "no recompute: faster where memory allows"),
    "critic.model.enable_gradient_checkpointing": (True, "no recompute: faster where memory allows"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (None, "a working micro-batch without use_dynamic_bsz"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (None, "the actor's micro-batch"),
    "actor_rollout_ref.rollout.seed": (42, "null: trainer.seed, one seed per run"),
    "actor_rollout_ref.rollout.max_num_seqs": (256, "megarl's cap on the sequences an engine holds at once"),
    "critic.ppo_max_token_len_per_gpu": (32768, "null: the actor's budget (16384)"),
    "reward_model.num_workers": (None, "a Ray pool of 2 (verl 0.9.1's null reads reward.num_workers, 8)"),
    "algorithm.filter_groups.metric": ("reward", "acc, the rule scorers' correctness field"),
    "algorithm.filter_groups.max_num_gen_batches": (0, "a reward no group varies on stops the run after 10 rounds "
                                                        "(0: verl's, retries forever)"),
    "trainer.total_epochs": (30, "one pass over the data unless asked"),
    "actor_rollout_ref.actor.use_torch_compile": (True, "megatron-core's own kernels, not torch.compile (true is "
                                                        "refused: megarl/config/refused.py)"),
}


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


# An OWN key matters only where its part runs: key prefix -> the switch of that part.
APPLIES = {"critic.": "critic.enable", "algorithm.filter_groups.": "algorithm.filter_groups.enable",
           "reward_model.num_workers": "reward_model.launch_reward_fn_async"}


def own_defaults_note(cfg: Any, defaults: Any) -> str | None:
    """One line naming each OWN key `cfg` leaves at megarl's default (`defaults`: the default tree) where its
    part runs, or None. The reasons are in OWN and docs/verl.md#defaults."""
    off = [prefix for prefix, switch in APPLIES.items() if not _get(cfg, switch)]
    used = [f"{key}={_get(cfg, key)!r} (verl: {verl!r})" for key, (verl, _) in OWN.items()
            if _get(cfg, key) == _get(defaults, key) and _get(cfg, key) != verl
            and not any(key.startswith(p) for p in off)]
    if not used:
        return None
    return f"megarl: defaults that differ from verl 0.9.1's (why: docs/verl.md#defaults): {', '.join(used)}"
