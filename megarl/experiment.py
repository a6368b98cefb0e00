"""The whole experiment: one typed tree composed of the components' own configs.

    data                    megarl/data/config.py
    actor_rollout_ref       model, actor, ref (megarl/workers/config.py) and rollout (megarl/rollout/config.py)
    critic                  megarl/workers/config.py
    reward_model            megarl/reward/config.py
    custom_reward_function  megarl/reward/config.py
    algorithm               megarl/algos/config.py
    trainer                 megarl/trainer/config.py (layout, checkpoints, logging)
    async_training          megarl/trainer/config.py (disaggregated rollout: staleness, partial rollout)

Each component validates its own fields; this module checks the rules that span components.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import yaml

from megarl.algos import config as algo_rules
from megarl.algos.config import AlgorithmConfig
from megarl.algos.registry import check_algorithm_names
from megarl.config.errors import ConfigError
from megarl.config.interpolate import resolve
from megarl.config.loader import apply_overrides, deep_merge, read_yaml
from megarl.config.model_path import confine_bootstrap, use_hub_cache
from megarl.config.recipe_keys import refuse_recipe_keys
from megarl.config.refused import (check_refused, check_reward_kwargs, drop_legacy_nulls, move_sections,
                                   rename_keys, take_reward_kwargs)
from megarl.config.stack import check_transformer_overrides
from megarl.config.typed import (Section, all_keys, build, defaults_of, derive, freeze, key_like, not_a_key, open_keys,
                                 to_dict)
from megarl.config.verl_keys import (hint_keys, refuse_hydra_sections, same_section_hint, strip_verl_keys,
                                    verl_default)
from megarl.data.config import DataConfig
from megarl.models.converter_registry import check_converter_names
from megarl.models.hf_config import find_hf_config as read_hf_config  # the name its callers import
from megarl.models.hf_config import with_overrides
from megarl.reward import config_checks as reward_rules
from megarl.reward.config import CustomRewardFunctionConfig, RewardModelConfig
from megarl.rollout import config_checks as rollout_rules
from megarl.rollout.config import RolloutConfig
from megarl.trainer.config import AsyncTrainingConfig, TrainerConfig, check_val_only
from megarl.workers import config_checks as worker_rules
from megarl.workers.config import ActorConfig, CriticConfig, MegatronConfig, ModelConfig, RefConfig

__all__ = ["ExperimentConfig", "build_config", "load_config", "read_hf_config"]


@dataclass
class ActorRolloutRefConfig(Section):
    hybrid_engine: bool = True             # accepted for verl compatibility; see rollout.placement
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class ExperimentConfig(Section):
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)

    def __post_init__(self):
        self._fill_defaults_across_sections()
        self._check_cross_section_rules()
        freeze(self)

    def resolved(self, total_steps: int) -> "ExperimentConfig":
        """The run's resolved view: a frozen copy in which what is known only once the data is
        loaded is filled in (each optimizer's step count); this tree stays as it was."""
        return derive(self, {f"{key}.optim.total_training_steps": total_steps
                             for key, role in (("actor_rollout_ref.actor", self.actor), ("critic", self.critic))
                             if role.optim.total_training_steps < 0})

    # -- shortcuts used everywhere -------------------------------------------------------------
    @property
    def actor(self) -> ActorConfig:
        return self.actor_rollout_ref.actor

    @property
    def rollout(self) -> RolloutConfig:
        return self.actor_rollout_ref.rollout

    @property
    def model(self) -> ModelConfig:
        return self.actor_rollout_ref.model

    @property
    def train_world_size(self) -> int:
        """Ranks that train (all of them unless the rollout engine has ranks of its own)."""
        extra = self.rollout.disaggregated_ranks if self.rollout.placement == "disaggregated" else 0
        return self.trainer.world_size - extra

    def data_parallel_size(self, layout: MegatronConfig | None = None) -> int:
        layout = layout or self.actor.megatron
        return self.train_world_size // (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
                                         * layout.context_parallel_size)

    # -- rules ---------------------------------------------------------------------------------
    def _fill_defaults_across_sections(self) -> None:
        ro, data = self.rollout, self.data
        if ro.prompt_length is None:
            ro.prompt_length = data.max_prompt_length
            if self.async_training.partial_rollout:    # a chunk's prompt is the prompt + the response so far
                ro.prompt_length += data.max_response_length
        if ro.response_length is None:
            ro.response_length = data.max_response_length
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.needs_critic
        crit = self.critic
        if crit.megatron is None:              # each role its own copy of the actor's layout
            crit.megatron = copy.deepcopy(self.actor.megatron)
        if crit.ppo_mini_batch_size is None:
            crit.ppo_mini_batch_size = self.actor.ppo_mini_batch_size
        if crit.ppo_micro_batch_size_per_gpu is None:
            crit.ppo_micro_batch_size_per_gpu = self.actor.ppo_micro_batch_size_per_gpu
        if crit.ppo_epochs is None:
            crit.ppo_epochs = self.actor.ppo_epochs
        if crit.model.path is None and crit.model.init_from == "actor":
            crit.model.path = self.model.path
        if ro.log_prob_micro_batch_size_per_gpu is not None:
            # verl keeps the old-log-prob micro batch under rollout; megarl's actor computes them.
            if self.actor.log_prob_micro_batch_size_per_gpu not in (None, ro.log_prob_micro_batch_size_per_gpu):
                raise ConfigError(f"conflicts with actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu="
                                  f"{self.actor.log_prob_micro_batch_size_per_gpu}; set only one",
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
            self.actor.log_prob_micro_batch_size_per_gpu = ro.log_prob_micro_batch_size_per_gpu
        ref = self.actor_rollout_ref.ref
        self._check_lora(ref, crit)
        if ref.megatron is None:
            ref.megatron = copy.deepcopy(self.actor.megatron)
        if ref.log_prob_micro_batch_size_per_gpu is None:
            ref.log_prob_micro_batch_size_per_gpu = (self.actor.log_prob_micro_batch_size_per_gpu
                                                     or self.actor.ppo_micro_batch_size_per_gpu)
        if self.actor.log_prob_micro_batch_size_per_gpu is None:
            self.actor.log_prob_micro_batch_size_per_gpu = self.actor.ppo_micro_batch_size_per_gpu
        if self.model.tokenizer_path is None:
            self.model.tokenizer_path = self.model.path
        self._fill_token_budgets()
        rm = self.reward_model
        if rm.batch_deadline_s is None:
            rm.batch_deadline_s = 0.8 * self.trainer.collective_timeout_s
        elif rm.batch_deadline_s >= self.trainer.collective_timeout_s:
            raise ConfigError(f"{rm.batch_deadline_s:g}s is not below trainer.collective_timeout_s="
                              f"{self.trainer.collective_timeout_s:g}s: the other ranks, waiting for the rewards, "
                              "would time out first; lower it or raise the collective timeout",
                              "reward_model.batch_deadline_s")

    def _check_lora(self, ref, crit) -> None:
        """With LoRA the reference is the actor's frozen base (its shards, adapters off): what would
        give it weights or a layout of its own is refused, as is LoRA on the critic."""
        if crit.model.lora_rank:
            raise ConfigError("LoRA trains the actor only: a frozen critic backbone would leave its value head "
                              "alone to learn; set it to 0", "critic.model.lora_rank")
        if not self.model.lora_rank:
            return
        if ref.megatron is not None and ref.megatron != self.actor.megatron:   # a written config holds a copy
            raise ConfigError("with LoRA the reference is the actor's frozen base on the actor's layout; remove "
                              "the reference's own megatron section", "actor_rollout_ref.ref.megatron")
        if ref.param_offload:
            raise ConfigError("with LoRA the reference holds no weights of its own (it is the actor with adapters "
                              "off); remove the key", "actor_rollout_ref.ref.param_offload")

    def _fill_token_budgets(self) -> None:
        """verl's defaults: every pass takes the actor's dynamic-batch switch and token budget."""
        actor, crit = self.actor, self.critic
        for section, switch, budget in ((self.rollout, "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
                                        (self.actor_rollout_ref.ref, "log_prob_use_dynamic_bsz",
                                         "log_prob_max_token_len_per_gpu"),
                                        (crit, "use_dynamic_bsz", "ppo_max_token_len_per_gpu")):
            if getattr(section, switch) is None:
                setattr(section, switch, actor.use_dynamic_bsz)
            if getattr(section, budget) is None:
                setattr(section, budget, actor.ppo_max_token_len_per_gpu)
        if crit.forward_max_token_len_per_gpu is None:
            crit.forward_max_token_len_per_gpu = crit.ppo_max_token_len_per_gpu

    def token_budgets(self) -> list[tuple[str, int | None]]:
        """(key, budget) of every pass that cuts micro-batches by tokens (each set once the tree is built)."""
        ro, ref, crit = self.rollout, self.actor_rollout_ref.ref, self.critic
        out: list[tuple[str, int | None]] = []
        if self.actor.use_dynamic_bsz:
            out.append(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", self.actor.ppo_max_token_len_per_gpu))
        if ro.log_prob_use_dynamic_bsz:
            out.append(("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", ro.log_prob_max_token_len_per_gpu))
        if ref.log_prob_use_dynamic_bsz:
            out.append(("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu))
        if crit.enable and crit.use_dynamic_bsz:
            out += [("critic.ppo_max_token_len_per_gpu", crit.ppo_max_token_len_per_gpu),
                    ("critic.forward_max_token_len_per_gpu", crit.forward_max_token_len_per_gpu)]
        return out

    def _check_cross_section_rules(self) -> None:
        for rule in RULES:
            rule(self)

    # -- model-dependent rules (need the HF config.json) ----------------------------------------
    def check_model(self, hf_config: dict) -> None:
        """Refuse layouts that cannot shard this model (its config.json with model.override_config
        applied), before any rank allocates memory."""
        hf_config = with_overrides(hf_config, self.model.override_config)
        for rule in MODEL_RULES:
            rule(self, hf_config)

    def to_dict(self) -> dict:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# The rules that span sections, each owned by the component it protects, in the order they run.
RULES = (check_algorithm_names, check_converter_names, algo_rules.check_group_size, algo_rules.check_critic_on,
         algo_rules.check_bypass_mode,
         rollout_rules.check_engine_ranks, rollout_rules.check_process_ray, rollout_rules.check_engine_overrides,
         rollout_rules.check_engine_trust_remote_code,
         rollout_rules.check_disaggregated_layout,
         rollout_rules.check_async_loop_features, rollout_rules.check_sync_backend, rollout_rules.check_delta_sync,
         rollout_rules.check_disaggregated_only_keys, rollout_rules.check_partial_rollout_room,
         rollout_rules.check_kv_after_update,
         worker_rules.check_layout_divides_ranks, worker_rules.check_one_layout, rollout_rules.check_rollout_tp,
         worker_rules.check_train_batch, worker_rules.check_mini_batches, rollout_rules.check_max_model_len,
         worker_rules.check_token_budgets, worker_rules.check_routing_replay, reward_rules.check_reward_model_keys,
         check_transformer_overrides, check_val_only)
MODEL_RULES = (worker_rules.check_model_layout, rollout_rules.check_model_positions, worker_rules.check_model_spec,
               rollout_rules.check_model_rollout_tp, rollout_rules.check_model_head_dim,
               worker_rules.check_routing_replay_model, worker_rules.check_model_on_cpu)


def _leaf_paths(node: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.append(path)
        if isinstance(value, dict):
            out.extend(_leaf_paths(value, path))
    return out


def check_known_keys(raw: dict) -> None:
    """Name the first unknown key: with the full key it ends (`rollout.n=5` -> `actor_rollout_ref.rollout.n`),
    else with the closest key of its own section (megarl's or verl's), else alone."""
    refuse_hydra_sections(raw)
    known = set(all_keys(ExperimentConfig))
    free = open_keys(ExperimentConfig)
    paths = _leaf_paths(raw)

    def accepted(path: str) -> bool:
        return path in known or any(path.startswith(f + ".") for f in free)

    for path in paths:
        if accepted(path):
            continue
        parts = path.split(".")
        for i, part in enumerate(parts):
            if not key_like(part):
                raise not_a_key(part, ".".join(parts[:i]))
        below = sorted((p for p in paths if p == path or p.startswith(path + ".")), key=lambda p: -p.count("."))
        for deeper in below:  # `rollout.n` -> `actor_rollout_ref.rollout.n`
            suffix = sorted(k for k in hint_keys(known) if k.endswith("." + deeper))
            if suffix:
                raise ConfigError(f"unknown key; did you mean '{suffix[0]}'?", deeper)
        hint = same_section_hint(path, known)
        raise ConfigError(f"unknown key; did you mean '{hint}'?" if hint else "unknown key", path)


# The reference's megatron keys that verl defaults to the actor's (`${oc.select:actor_rollout_ref.actor.megatron.
# <key>,...}` in its trees): a reference section that sets a few keys keeps the actor's value for the others.
REF_FOLLOWS_ACTOR = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "param_offload", "seed", "override_transformer_config")


def _ref_follows_actor(merged: dict) -> dict:
    arr = merged.get("actor_rollout_ref")
    ref = arr.get("ref") if isinstance(arr, dict) else None
    actor = (arr.get("actor") or {}).get("megatron") if isinstance(arr, dict) else None
    if isinstance(ref, dict) and isinstance(ref.get("megatron"), dict) and isinstance(actor, dict):
        for key in REF_FOLLOWS_ACTOR:
            if key not in ref["megatron"] and key in actor:
                ref["megatron"][key] = copy.deepcopy(actor[key])
    return merged


def build_config(raw: dict) -> ExperimentConfig:
    raw = move_sections(copy.deepcopy(raw))       # verl's other spellings (megarl/config/refused.py MOVED)
    raw = rename_keys(raw)                        # verl 0.9.1's moved keys (megarl/config/refused.py RENAMED)
    raw, resp_lens = take_reward_kwargs(raw)      # verl's reward_kwargs (megarl/config/refused.py)
    raw = refuse_recipe_keys(raw)                 # verl's async recipes' keys (megarl/config/recipe_keys.py)
    raw = drop_legacy_nulls(raw)                  # verl 0.9.1's null for "not set" (megarl/config/refused.py)
    raw = strip_verl_keys(raw, ExperimentConfig)  # verl-only keys at verl's default (megarl/config/verl_keys.py)
    check_known_keys(raw)
    merged = _ref_follows_actor(resolve(deep_merge(defaults_of(ExperimentConfig), raw), verl_default))
    check_refused(merged)
    check_reward_kwargs(merged, resp_lens)
    return build(ExperimentConfig, merged)


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read `path` (with its bases), apply `a.b=c` overrides, and return the validated tree."""
    raw = read_yaml(path) if path else {}
    raw = apply_overrides(raw, list(overrides))
    confine_bootstrap(raw, path, list(overrides))   # a bootstrap builds only its own path (config/model_path.py)
    use_hub_cache(raw)                              # a hub id already in HF_HOME's cache: its snapshot, no download
    try:
        return build_config(raw)
    except ConfigError as err:
        raise _with_plus_note(err, overrides) from None


def _with_plus_note(err: ConfigError, overrides) -> ConfigError:
    """Hydra's `+key=value` adds a key verl's config lacks; megarl reads it as `key=value`, so a key
    megarl does not know is refused as any other; its error says so."""
    plus = [o.split("=", 1)[0].strip()[1:] for o in overrides if o.strip().startswith("+")]
    hit = next((k for k in plus if err.key and (err.key == k or k.startswith(err.key + ".")
                                               or err.key.startswith(k + "."))), None)
    if hit is None or "unknown key" not in err.bare:
        return err
    return ConfigError(f"{err.bare} (megarl reads Hydra's +{hit} as {hit}: every key megarl reads exists already, "
                       "and one it does not know is refused, not added)", err.key)
