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

import json
import os
from dataclasses import dataclass, field

import yaml

from megarl.algos.config import AlgorithmConfig
from megarl.config.errors import ConfigError
from megarl.config.interpolate import resolve
from megarl.config.loader import apply_overrides, deep_merge, read_yaml
from megarl.config.model_path import confine_bootstrap
from megarl.config.refused import check_refused
from megarl.config.typed import all_keys, build, defaults_of, open_keys, to_dict
from megarl.config.verl_keys import same_section_hint, strip_verl_keys
from megarl.data.config import DataConfig
from megarl.reward.config import CustomRewardFunctionConfig, RewardModelConfig
from megarl.rollout.config import RolloutConfig
from megarl.trainer.config import AsyncTrainingConfig, TrainerConfig
from megarl.workers.config import ActorConfig, CriticConfig, MegatronConfig, ModelConfig, RefConfig


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True             # accepted for verl compatibility; see rollout.placement
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class ExperimentConfig:
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
        if ro.response_length is None:
            ro.response_length = data.max_response_length
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.needs_critic
        crit = self.critic
        if crit.megatron is None:
            crit.megatron = self.actor.megatron
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
        if ref.megatron is None:
            ref.megatron = self.actor.megatron
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
        total = self.trainer.total_training_steps
        for optim in (self.actor.optim, self.critic.optim):
            if optim.total_training_steps < 0 and total is not None:
                optim.total_training_steps = total

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

    def token_budgets(self) -> list[tuple[str, int]]:
        """(key, budget) of every pass that cuts micro-batches by tokens."""
        ro, ref, crit = self.rollout, self.actor_rollout_ref.ref, self.critic
        out = []
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
        algo, actor, ro, data, tr = self.algorithm, self.actor, self.rollout, self.data, self.trainer
        if algo.is_group_relative and ro.n < 2:
            raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator} compares the responses of one "
                              f"prompt, so it needs actor_rollout_ref.rollout.n >= 2 (got {ro.n})",
                              "actor_rollout_ref.rollout.n")
        if algo.needs_critic and not self.critic.enable:
            raise ConfigError("algorithm.adv_estimator=gae needs a critic; set critic.enable=true or pick "
                              "a critic-free estimator such as grpo", "critic.enable")
        if ro.placement == "disaggregated" and ro.disaggregated_ranks >= tr.world_size:
            raise ConfigError(f"gives all {tr.world_size} ranks to the engine; leave some for training or "
                              "raise trainer.n_gpus_per_node", "actor_rollout_ref.rollout.disaggregated_ranks")
        if ro.placement == "disaggregated" and (actor.megatron.context_parallel_size > 1
                                                or (actor.megatron.virtual_pipeline_model_parallel_size or 1) > 1):
            raise ConfigError("the disaggregated weight sync addresses trainer ranks by TP x PP x DP only; use "
                              "context_parallel_size=1 and virtual_pipeline_model_parallel_size=null with it, or "
                              "placement=colocated", "actor_rollout_ref.rollout.placement")
        if ro.placement == "disaggregated":
            # The async loop (megarl/trainer/fit_async.py) hands whole batches over; these need the
            # engine inside the trainer's step.
            for on, key, why in ((algo.filter_groups.enable, "algorithm.filter_groups.enable",
                                  "dynamic sampling regenerates inside the trainer's step"),
                                 (ro.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable",
                                  "multi-turn rollouts are not wired into the rollout ranks' loop yet"),
                                 (self.reward_model.enable, "reward_model.enable",
                                  "a model reward runs on the trainer ranks' megatron layout, not wired here yet"),
                                 *((getattr(role.megatron, k), f"{name}.megatron.{k}",
                                    "offload frees device memory for a colocated engine; the trainer ranks host none")
                                   for name, role in (("actor_rollout_ref.actor", actor), ("critic", self.critic))
                                   for k in ("param_offload", "grad_offload", "optimizer_offload"))):
                if on:
                    raise ConfigError(f"is not supported with rollout.placement=disaggregated ({why}); set it "
                                      "to false or use placement=colocated", key)
            if ro.checkpoint_engine.backend not in ("auto", "distributed"):
                raise ConfigError(f"is {ro.checkpoint_engine.backend}, but placement=disaggregated moves weights over "
                                  "the distributed transport; set backend=auto or distributed",
                                  "actor_rollout_ref.rollout.checkpoint_engine.backend")
        elif ro.checkpoint_engine.keep_previous_weights is not None:
            raise ConfigError("applies to the distributed transport (placement=disaggregated) only; remove it",
                              "actor_rollout_ref.rollout.checkpoint_engine.keep_previous_weights")
        elif self.async_training.partial_rollout:
            raise ConfigError("needs actor_rollout_ref.rollout.placement=disaggregated (the colocated loop is "
                              "synchronous)", "async_training.partial_rollout")
        for role, layout in (("actor_rollout_ref.actor", actor.megatron),
                             ("critic", self.critic.megatron), ("actor_rollout_ref.ref", self.actor_rollout_ref.ref.megatron)):
            if role == "critic" and not self.critic.enable:
                continue
            tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
            cp = layout.context_parallel_size
            if self.train_world_size % (tp * pp * cp):
                cp_text = f" x CP {cp}" if cp > 1 else ""
                raise ConfigError(
                    f"TP {tp} x PP {pp}{cp_text} = {tp * pp * cp} does not divide the {self.train_world_size} "
                    "training ranks "
                    f"(trainer.nnodes x trainer.n_gpus_per_node{' minus rollout.disaggregated_ranks' if ro.placement == 'disaggregated' else ''}); "
                    f"so TP x PP x CP x DP cannot equal the world size: change the layout or the rank count",
                    f"{role}.megatron.tensor_model_parallel_size")
        # megatron's parallel_state is process-global: every role in a process shares one layout.
        actor_layout = _shared_layout(actor.megatron)
        for role, layout in (("critic", self.critic.megatron if self.critic.enable else None),
                             ("actor_rollout_ref.ref", self.actor_rollout_ref.ref.megatron)):
            if layout is not None and _shared_layout(layout) != actor_layout:
                theirs = _shared_layout(layout)
                raise ConfigError(
                    f"TP x PP x CP x VPP x EP {theirs} differs from the actor's {actor_layout}; roles share one "
                    f"megatron layout, so {role} must use the actor's layout (remove its tensor/pipeline/context/"
                    "virtual_pipeline/expert sizes)", f"{role}.megatron.tensor_model_parallel_size")
        dp = self.data_parallel_size()
        rollout_ranks = ro.disaggregated_ranks if ro.placement == "disaggregated" else tr.world_size
        if rollout_ranks % ro.tensor_model_parallel_size:
            raise ConfigError(f"rollout TP {ro.tensor_model_parallel_size} does not divide the {rollout_ranks} "
                              "rollout ranks; pick a divisor", "actor_rollout_ref.rollout.tensor_model_parallel_size")
        if data.train_batch_size % actor.ppo_mini_batch_size:
            raise ConfigError(f"data.train_batch_size={data.train_batch_size} is not a multiple of "
                              f"ppo_mini_batch_size={actor.ppo_mini_batch_size}; make the mini batch a divisor",
                              "actor_rollout_ref.actor.ppo_mini_batch_size")
        for role, mini, micro in (("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu),
                                  ("critic", self.critic.ppo_mini_batch_size, self.critic.ppo_micro_batch_size_per_gpu)):
            if role == "critic" and not self.critic.enable:
                continue
            seqs = mini * ro.n
            if seqs % (micro * dp):
                raise ConfigError(
                    f"a mini batch holds ppo_mini_batch_size x rollout.n = {mini} x {ro.n} = {seqs} sequences, "
                    f"not divisible by ppo_micro_batch_size_per_gpu x DP = {micro} x {dp}; change one of them",
                    f"{role}.ppo_micro_batch_size_per_gpu")
            lay = actor.megatron if role != "critic" else self.critic.megatron
            vpp, pp = lay.virtual_pipeline_model_parallel_size or 1, lay.pipeline_model_parallel_size
            if vpp > 1 and (seqs // (micro * dp)) % pp:
                raise ConfigError(
                    f"under virtual pipeline (VPP {vpp}) megatron's interleaved schedule needs the micro-batches "
                    f"per mini batch, {seqs} / (micro {micro} x DP {dp}) = {seqs // (micro * dp)}, to be a multiple "
                    f"of PP {pp}; e.g. ppo_micro_batch_size_per_gpu={_vpp_micro(seqs, dp, pp) or 'smaller'}",
                    f"{role}.ppo_micro_batch_size_per_gpu")
        if ro.max_model_len is not None and ro.prompt_length + ro.response_length > ro.max_model_len:
            raise ConfigError(f"{ro.max_model_len} is less than prompt {ro.prompt_length} + response "
                              f"{ro.response_length} tokens; raise it or lower data.max_prompt_length / "
                              "data.max_response_length", "actor_rollout_ref.rollout.max_model_len")
        longest = ro.prompt_length + ro.response_length
        if self.token_budgets() and actor.megatron.pipeline_model_parallel_size > 1 and not (
                self.model.use_remove_padding and self.critic.model.use_remove_padding):
            raise ConfigError("token-budget micro-batches under pipeline parallelism need packed sequences (padded "
                              "ones of different row counts cannot share the pipeline's fixed shape); set it to true "
                              "or turn off use_dynamic_bsz", "actor_rollout_ref.model.use_remove_padding")
        vpp = actor.megatron.virtual_pipeline_model_parallel_size or 1
        if self.token_budgets() and vpp > 1:
            raise ConfigError(f"token-budget micro-batches vary in count, but the interleaved schedule (VPP {vpp}) "
                              "needs a multiple of PP; turn off use_dynamic_bsz or virtual pipelining",
                              "actor_rollout_ref.actor.use_dynamic_bsz")
        for key, budget in self.token_budgets():
            if budget < longest:
                raise ConfigError(f"a token budget of {budget} is smaller than the longest sequence, prompt_length "
                                  f"{ro.prompt_length} + response_length {ro.response_length} = {longest}; raise it to "
                                  f"at least {longest}", key)

    # -- model-dependent rules (need the HF config.json) ----------------------------------------
    def check_model(self, hf_config: dict) -> None:
        """Refuse layouts that cannot shard this model, before any rank allocates memory."""
        heads = hf_config.get("num_attention_heads")
        kv = hf_config.get("num_key_value_heads") or heads
        layers = hf_config.get("num_hidden_layers")
        layouts = [("actor_rollout_ref.actor", self.actor.megatron),
                   ("actor_rollout_ref.ref", self.actor_rollout_ref.ref.megatron)]
        if self.critic.enable:
            layouts.append(("critic", self.critic.megatron))
        for role, layout in layouts:
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
        positions = hf_config.get("max_position_embeddings")
        ro = self.rollout
        if positions and ro.prompt_length + ro.response_length > positions:
            room = positions - ro.prompt_length
            fix = (f"lower data.max_response_length to at most {room}" if room >= 1 else
                   f"lower data.max_prompt_length below {positions} and leave room for a response")
            raise ConfigError(f"prompt {ro.prompt_length} + response {ro.response_length} tokens = "
                              f"{ro.prompt_length + ro.response_length} exceed the model's {positions} positions "
                              f"(max_position_embeddings); {fix}", "data.max_response_length")
        self._check_model_spec(hf_config, layouts)
        rtp = self.rollout.tensor_model_parallel_size
        if heads % rtp or kv % rtp:
            raise ConfigError(f"rollout TP {rtp} must divide the model's {heads} attention heads and {kv} KV "
                              "groups", "actor_rollout_ref.rollout.tensor_model_parallel_size")

    def _check_model_spec(self, hf_config: dict, layouts) -> None:
        """Expert-parallel layouts (MoE) and Mistral's sliding window, judged on megarl's ModelSpec."""
        from megarl.models.spec import ModelSpec, check_experts, check_window
        try:
            spec = ModelSpec.from_hf_config(hf_config)
        except ValueError:
            return                             # the workers refuse the model itself, with its reason
        for role, layout in layouts:
            tp, pp, ep = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                          layout.expert_model_parallel_size)
            try:
                check_experts(spec, tp, pp, ep, layout.expert_tensor_parallel_size, self.train_world_size)
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
        ro, data = self.rollout, self.data
        longest = max((ro.prompt_length or data.max_prompt_length) + (ro.response_length or data.max_response_length),
                      data.max_prompt_length + data.max_response_length)
        try:
            check_window(spec, longest)
        except ValueError as err:
            raise ConfigError(str(err), "data.max_response_length") from None

    def to_dict(self) -> dict:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _shared_layout(m: MegatronConfig) -> tuple:
    """What megatron's process-global parallel_state fixes: (TP, PP, CP, VPP, EP)."""
    return (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size,
            m.virtual_pipeline_model_parallel_size or 1, m.expert_model_parallel_size)


def _vpp_micro(seqs: int, dp: int, pp: int) -> int | None:
    """The largest micro-batch size whose micro-batch count per mini batch is a multiple of PP."""
    return next((m for m in range(seqs // (dp * pp), 0, -1) if seqs % (m * dp * pp) == 0), None)


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
    known = set(all_keys(ExperimentConfig))
    free = open_keys(ExperimentConfig)
    paths = _leaf_paths(raw)

    def accepted(path: str) -> bool:
        return path in known or any(path.startswith(f + ".") for f in free)

    for path in paths:
        if accepted(path):
            continue
        below = sorted((p for p in paths if p == path or p.startswith(path + ".")), key=lambda p: -p.count("."))
        for deeper in below:  # `rollout.n` -> `actor_rollout_ref.rollout.n`
            suffix = sorted(k for k in known if k.endswith("." + deeper))
            if suffix:
                raise ConfigError(f"unknown key; did you mean '{suffix[0]}'?", deeper)
        hint = same_section_hint(path, known)
        raise ConfigError(f"unknown key; did you mean '{hint}'?" if hint else "unknown key", path)


def build_config(raw: dict) -> ExperimentConfig:
    raw = strip_verl_keys(raw)             # verl-only keys at verl's default (megarl/config/verl_keys.py)
    check_known_keys(raw)
    merged = resolve(deep_merge(defaults_of(ExperimentConfig), raw))
    check_refused(merged)
    return build(ExperimentConfig, merged)


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read `path` (with its bases), apply `a.b=c` overrides, and return the validated tree."""
    raw = read_yaml(path) if path else {}
    raw = apply_overrides(raw, list(overrides))
    confine_bootstrap(raw, path, list(overrides))   # a bootstrap builds only its own path (config/model_path.py)
    return build_config(raw)


def read_hf_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
