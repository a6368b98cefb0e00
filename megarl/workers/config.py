"""Configuration of the Megatron-side roles: actor, reference, critic (verl's keys).

    actor_rollout_ref.model.*        the HF checkpoint the actor, reference and rollout share
    actor_rollout_ref.actor.*        policy optimisation (PPO epochs, clipping, optimiser, layout)
    actor_rollout_ref.ref.*          the frozen reference policy
    critic.*                         the value model
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.typed import Section, require
from megarl.models.lora_options import LoraOptions, converter_entry, parse_targets


CHECKPOINT_KWARGS = {"activations_checkpoint_granularity": "recompute_granularity",
                     "activations_checkpoint_method": "recompute_method",
                     "activations_checkpoint_num_layers": "recompute_num_layers"}


def recompute_overrides(checkpoint_kwargs: dict) -> dict[str, Any]:
    """model.gradient_checkpointing_kwargs as TransformerConfig keys (use_reentrant, HF's flag, has no
    megatron counterpart: megatron's recompute is its own autograd Function)."""
    return {CHECKPOINT_KWARGS[k]: v for k, v in checkpoint_kwargs.items() if k in CHECKPOINT_KWARGS}


@dataclass
class ModelConfig(Section):
    path: str | None = None                # an HF checkpoint directory (config.json + safetensors)
    tokenizer_path: str | None = None      # None: the same directory as `path`
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)  # merged into the HF config
    # An import path `pkg.module:function(model_dir, config)` that creates the checkpoint at
    # `path` when it does not exist yet (rank 0 runs it, the others wait). The quickstart uses
    # it to build and warm-start its small model locally.
    bootstrap: str | None = None
    bootstrap_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    # Older verl's megatron names for the recompute settings (activations_checkpoint_granularity,
    # _method, _num_layers); <role>.megatron.override_transformer_config.recompute_* win over them.
    gradient_checkpointing_kwargs: dict[str, Any] = field(default_factory=dict)
    # Pack each micro-batch's sequences back to back (THD, no compute on padding); false: right-pad
    # every row to the batch's longest (verl's key; megarl/workers/packing.py).
    use_remove_padding: bool = True
    external_lib: str | None = None        # a module imported before the model is built (custom architectures)
    # Model converters (megarl/models/converters.py) run on the loaded chunks before DDP and the
    # optimizer wrap them: a list of registered names, or name -> options. Empty: none.
    converters: list[str] | dict[str, dict[str, Any]] = field(default_factory=list)
    # LoRA (verl's keys; megarl/models/lora.py, docs/lora.md): lora_rank > 0 freezes the base and
    # trains rank-r adapters on `target_modules` ("all-linear", or HF names q_proj ... down_proj,
    # or megatron's linear_qkv ... linear_fc2); scale lora_alpha / lora_rank, as PEFT's.
    lora_rank: int = 0
    lora_alpha: float = 16
    target_modules: str | list[str] = "all-linear"
    lora_dropout: float = 0.0

    def __post_init__(self):
        unknown = sorted(set(self.gradient_checkpointing_kwargs) - set(CHECKPOINT_KWARGS) - {"use_reentrant"})
        require(not unknown, f"gradient_checkpointing_kwargs.{unknown[0] if unknown else ''}",
                f"unknown key; use {', '.join(CHECKPOINT_KWARGS)} or <role>.megatron.override_transformer_config."
                "recompute_granularity / recompute_method / recompute_num_layers")
        require(self.lora_rank >= 0, "lora_rank", f"must be >= 0 (got {self.lora_rank}); 0 turns LoRA off")
        if self.lora_rank:
            require("lora" not in self.converters, "converters",
                    "names lora as well as lora_rank > 0; configure LoRA through lora_rank / lora_alpha only")
            try:
                LoraOptions(self.lora_rank, float(self.lora_alpha), parse_targets(self.target_modules),
                            float(self.lora_dropout)).check()
            except ValueError as err:
                require(False, "target_modules" if "target_modules" in str(err) else "lora_rank", str(err))

    def converter_options(self) -> dict[str, dict[str, Any]]:
        """`converters` as name -> options, with the `lora` converter (megarl/models/lora.py) added
        when lora_rank > 0."""
        named = dict(self.converters) if isinstance(self.converters, dict) else {n: {} for n in self.converters}
        return {**named, **converter_entry(self)}

    @property
    def reference_is_base(self) -> bool:
        """The reference policy is the actor's own model before its converters (LoRA's frozen base),
        not a model of its own."""
        return bool(self.lora_rank)

    def converters_summary(self) -> str:
        """The start-up line's words for what the converters do to the trainer ("" for none)."""
        if not self.lora_rank:
            return ""
        return (f"; LoRA rank {self.lora_rank}, alpha {self.lora_alpha:g}, on {self.target_modules} "
                "(base frozen; the reference is the base)")



# override_ddp_config keys megarl passes to megatron-core's DistributedDataParallelConfig, with the
# type each takes. overlap_grad_reduce starts each gradient bucket's all-reduce (reduce-scatter under
# the distributed optimizer) during the backward pass; bucket_size sets the bucket (elements).
DDP_OVERRIDES = {"overlap_grad_reduce": bool, "bucket_size": int}
# Parameter-gather overlap defers the all-gather after the step to the next forward pass; megarl's
# weight sync reads the parameters in between, so it would send stale shards. megatron also ignores
# the option without the distributed optimizer, which CPU runs lack.
_DDP_REFUSED = ("overlap_param_gather", "align_param_gather")


def check_ddp_overrides(overrides: dict[str, Any]) -> None:
    key = "override_ddp_config"
    require(isinstance(overrides, dict), key, "must be a mapping of megatron DDP options, e.g. "
            "{overlap_grad_reduce: true}")
    for name, value in overrides.items():
        if name in _DDP_REFUSED:
            require(value is False, f"{key}.{name}", "is not supported: megarl's weight sync reads the parameters "
                    "right after the optimizer step, before the all-gather it would defer to the next forward "
                    "(and megatron ignores it without the distributed optimizer); remove it or set false")
            continue
        want = DDP_OVERRIDES.get(name)
        require(want is not None, f"{key}.{name}", f"is not one of the DDP options megarl passes to megatron: "
                f"{', '.join(sorted(DDP_OVERRIDES))} (the overlap settings); remove it")
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        require(ok or (name == "bucket_size" and value is None), f"{key}.{name}",
                f"must be {'true or false' if want is bool else 'a number of elements or null'}, got {value!r}")
        require(name != "bucket_size" or value is None or value > 0, f"{key}.{name}", "must be > 0 elements or null")


@dataclass
class MegatronConfig(Section):
    """How one role's model is sharded. TP x CP x PP x DP must equal the number of ranks."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Model chunks per pipeline stage (megatron's interleaved 1F1B); null or 1: none. The layers
    # must divide by PP x VPP, and each mini-batch's micro-batch count by PP.
    virtual_pipeline_model_parallel_size: int | None = None
    # Ranks that split each sequence (load-balanced 2 x CP chunks; megarl/models/context_parallel.py).
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1    # MoE: experts split over this many of the DP ranks
    expert_tensor_parallel_size: int | None = None  # None: TP (the only value megarl supports)
    # null: on exactly when TP > 1 (as verl defaults it). It splits norm/residual activations over
    # TP for the same communication volume and the same results (tests/test_parallel_layouts.py).
    sequence_parallel: bool | None = None
    use_distributed_optimizer: bool | None = None  # None: on with CUDA (megatron's); CPU has none, off there
    param_offload: bool = False            # move weights to host memory while the role is idle
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    dist_checkpointing_path: str | None = None  # load from a megatron distributed checkpoint instead of HF
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    # verl's key: megatron-core's DistributedDataParallelConfig options, of which megarl takes the
    # communication-overlap ones (DDP_OVERRIDES); a frozen role (the reference) has no DDP to tune.
    override_ddp_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_ddp_overrides(self.override_ddp_config)
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size"):
            require(getattr(self, key) >= 1, key, "must be >= 1")
        vpp = self.virtual_pipeline_model_parallel_size
        require(vpp is None or vpp >= 1, "virtual_pipeline_model_parallel_size", "must be null or >= 1")
        require(vpp in (None, 1) or self.pipeline_model_parallel_size > 1, "virtual_pipeline_model_parallel_size",
                f"{vpp} needs pipeline_model_parallel_size > 1 (chunks interleave over pipeline stages); "
                "set it to null, or use e.g. pipeline_model_parallel_size=2 with it")
        require(self.expert_tensor_parallel_size is None or
                self.expert_tensor_parallel_size == self.tensor_model_parallel_size, "expert_tensor_parallel_size",
                "must equal tensor_model_parallel_size (megarl shards experts over the TP group); leave it null")

    @property
    def sequence_parallel_on(self) -> bool:
        """`sequence_parallel`, with null meaning on exactly when TP > 1. true at TP 1 is off, as verl reads
        its own default (true): there is no TP group to split the sequence over."""
        if self.sequence_parallel is None or self.tensor_model_parallel_size == 1:
            return self.tensor_model_parallel_size > 1
        return bool(self.sequence_parallel)


@dataclass
class OptimConfig(Section):
    # "adam" is megatron's (verl's megatron default): decoupled weight decay, the same update as
    # "adamw". verl's FSDP configs name torch classes: "AdamW" is read as adamw; torch's "Adam" puts
    # weight decay into the gradient (L2), which megarl does not offer, so it is refused.
    optimizer: str = "adamw"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = -1              # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = None      # None: trainer.total_training_steps
    total_training_steps: int = -1         # filled in from the trainer at run time

    def __post_init__(self):
        if self.optimizer == "AdamW":
            self.optimizer = "adamw"
        require(self.optimizer != "Adam", "optimizer",
                "torch's Adam (weight decay added to the gradient) is not offered; megarl's adam/adamw decay "
                "weights decoupled (megatron's adam, torch's AdamW): use adamw, or weight_decay=0 for plain Adam")
        require(self.optimizer in ("adam", "adamw"), "optimizer",
                f"got {self.optimizer!r}, expected 'adamw' (or megatron's 'adam', the same update; verl's 'AdamW')")
        require(self.lr >= 0, "lr", "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        require(self.clip_grad > 0, "clip_grad", "must be > 0")
        require(0.0 <= self.lr_warmup_steps_ratio <= 1.0, "lr_warmup_steps_ratio", "must be within [0, 1]")


@dataclass
class PolicyLossConfig(Section):
    loss_mode: str = "vanilla"  # a name in megarl.algos's policy-loss registry (vanilla, dual_clip, gspo, ...)
    # The chosen loss's own keys, written beside loss_mode (verl's clip_cov_ratio, dro_beta, ...): gathered
    # here as given, then typed and checked by the options class the loss registers, once every loss is
    # known (megarl/algos/registry.py check_algorithm_names; the built-ins' in megarl/algos/loss_options.py).
    options: Any = field(default=None, metadata={"plugin_keys": True})

    def __post_init__(self):
        require(self.loss_mode != "bypass_mode", "loss_mode",
                "verl's bypass_mode loss is megarl's algorithm.rollout_correction.bypass_mode=true with "
                "loss_mode=vanilla; set those")


@dataclass
class RouterReplayConfig(Section):
    """MoE routing replay (verl's `router_replay` section; megarl/models/routing_replay.py).
    disabled: every forward picks its own top-k experts. R2: the old-policy pass records its
    top-k (batch key `routed_experts`) and every update micro-batch replays it. R3: the rollout
    engine records the top-k of every token it runs (rollout.enable_rollout_routing_replay=true)
    and every trainer forward on those tokens replays it. The router softmax stays live, so the
    router weights still get gradients. verl's record_file / replay_file are refused
    (megarl/config/verl_keys.py): routes travel in the batch, never through files."""
    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class ActorConfig(Section):
    strategy: Literal["megatron"] = "megatron"
    ppo_mini_batch_size: int = 16          # prompts per optimiser step (x n responses each)
    # sequences per forward/backward on one data-parallel rank; null (verl's default) leaves every
    # micro-batch to the token budget, so it needs use_dynamic_bsz=true (verl asks the same)
    ppo_micro_batch_size_per_gpu: int | None = 4
    ppo_micro_batch_size: int | None = None  # verl's deprecated global form; per_gpu wins
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None    # None: clip_ratio
    clip_ratio_high: float | None = None   # None: clip_ratio (DAPO's clip-higher sets it larger)
    clip_ratio_c: float = 3.0              # dual-clip lower bound for negative advantages
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0                   # sapo's gate temperature where A > 0 (verl's key)
    tau_neg: float = 1.05                  # and where A <= 0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float | None = None         # verl's key; when set it overrides optim.clip_grad
    use_torch_compile: bool = False
    log_prob_micro_batch_size_per_gpu: int | None = None  # None: ppo_micro_batch_size_per_gpu
    # Micro-batches cut by a token budget per GPU instead of a row count (verl's keys); the budget
    # counts computed tokens: the sum of lengths when packed, rows x the longest row when padded.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: dict[str, Any] = field(default_factory=dict)  # accepted for verl compatibility
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self):
        require(self.ppo_mini_batch_size >= 1, "ppo_mini_batch_size", "must be >= 1")
        if self.ppo_micro_batch_size_per_gpu is None:
            require(self.use_dynamic_bsz, "ppo_micro_batch_size_per_gpu",
                    "null (verl's default) cuts micro-batches by tokens only, which needs "
                    "actor_rollout_ref.actor.use_dynamic_bsz=true; set that, or a number of sequences (e.g. 4)")
        else:
            require(self.ppo_micro_batch_size_per_gpu >= 1, "ppo_micro_batch_size_per_gpu", "must be >= 1")
        require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        require(self.ppo_max_token_len_per_gpu >= 1, "ppo_max_token_len_per_gpu", "must be >= 1")
        require(self.clip_ratio > 0, "clip_ratio", "must be > 0")
        require(self.clip_ratio_c > 1, "clip_ratio_c", "must be > 1 (dual-clip bound)")
        require(self.tau_pos > 0 and self.tau_neg > 0, "tau_pos", "sapo's temperatures must be > 0")
        if self.grad_clip is not None:
            self.optim.clip_grad = self.grad_clip


@dataclass
class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int | None = None  # None: the actor's
    megatron: MegatronConfig | None = None  # None: the actor's layout
    param_offload: bool = False            # keep the frozen weights in host memory between uses
    log_prob_use_dynamic_bsz: bool | None = None     # None: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # None: actor.ppo_max_token_len_per_gpu
    # R3 here: the reference replays the batch's routes too (the KL then compares the two models
    # under one expert selection); disabled: it routes itself (the KL against the reference as it
    # is). R2 has no meaning for a frozen model and is refused.
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self):
        require(self.router_replay.mode != "R2", "router_replay.mode",
                "R2 records in the actor's old-policy pass; for the reference use disabled (its own routes) "
                "or R3 (replay the batch's routes)")


@dataclass
class CriticModelConfig(ModelConfig):
    # Where the value head starts: "actor" copies the actor's backbone and zero-initialises the
    # head; "path" loads `critic.model.path` (e.g. a reward-model checkpoint with a score head).
    init_from: Literal["actor", "path"] = "actor"


@dataclass
class CriticConfig(Section):
    enable: bool | None = None             # None: on exactly when the advantage estimator needs values (gae)
    strategy: Literal["megatron"] = "megatron"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig | None = None  # None: the actor's layout
    ppo_mini_batch_size: int | None = None  # None: the actor's
    ppo_micro_batch_size_per_gpu: int | None = None
    ppo_epochs: int | None = None
    use_dynamic_bsz: bool | None = None    # None: the actor's
    ppo_max_token_len_per_gpu: int | None = None      # None: the actor's
    forward_max_token_len_per_gpu: int | None = None  # compute_values; None: ppo_max_token_len_per_gpu
    cliprange_value: float = 0.5
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    grad_clip: float | None = None

    def __post_init__(self):
        require(self.cliprange_value > 0, "cliprange_value", "must be > 0")
        if self.grad_clip is not None:
            self.optim.clip_grad = self.grad_clip
