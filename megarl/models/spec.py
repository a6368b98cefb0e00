"""ModelSpec: the facts about an HF checkpoint that megarl needs to build and map its shards.

    spec = ModelSpec.from_hf_config(json.load(open("ckpt/config.json")))
    check_layout(spec, tp=2, pp=2)          # ValueError naming the rule a layout breaks

Supported: the families registered in megarl/models/families/ (one file each: Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE). What they share is read here (RMSNorm, SwiGLU, RoPE with
the checkpoint's theta, GQA, tied or untied embeddings, `*ForCausalLM` or, for critics and reward
models, `*ForSequenceClassification` with a `score` head); what differs (QKV bias, the MLP flavour,
the sliding window, family refusals, code hooks such as Qwen3's q/k norm) the family decides.
Anything else is refused here, with the reason, before any rank builds a model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from megarl.models import families
from megarl.models.families.base import ModelFamily

VOCAB_DIVISOR = 128  # megatron's make_vocab_size_divisible_by default


@dataclass(frozen=True)
class ModelSpec:
    architecture: str                  # e.g. "Qwen2ForCausalLM"
    family: str                        # a registered family's name (megarl/models/families/)
    head: str                          # what the checkpoint ends in: "lm" (lm_head) or "score"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope_scaling_factor: float | None = None   # llama3-style scaling (megatron's rope_scaling)
    rope_linear_factor: float | None = None    # linear position interpolation
    num_labels: int = 1                        # rows of a `score` head
    sliding_window: int | None = None          # Mistral: attention window (refused where it could bind)
    # Mixture of experts (num_experts = 0: a dense MLP). Every layer is a MoE layer.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0               # one expert's intermediate size
    moe_topk: int = 0                          # experts per token
    moe_norm_topk: bool = False                # renormalise the top-k probabilities (norm_topk_prob)
    shared_expert_ffn: int = 0                 # Qwen2-MoE's shared expert (0: none); sigmoid-gated
    aux_loss_coef: float = 0.0                 # load-balancing loss coefficient (router_aux_loss_coef)
    z_loss_coef: float = 0.0                   # router z-loss coefficient (router_z_loss_coef)
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: per KV group, its query heads then one k and one v head."""
        return self.num_kv_heads * (self.q_per_group + 2) * self.head_dim

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of lcm(128, TP). For TP a power of two up to 128
        this does not depend on TP, so distributed checkpoints reload under another TP without
        reshaping the embedding (Megatron-LM's 128*TP rule would change it)."""
        unit = VOCAB_DIVISOR * tp // math.gcd(VOCAB_DIVISOR, tp)
        return -(-self.vocab_size // unit) * unit

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_family(self) -> ModelFamily:
        return families.get(self.family)

    def num_parameters(self, value_head: bool = False) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = self.qkv_rows * h + (self.qkv_rows if self.qkv_bias else 0) + self.num_heads * self.head_dim * h
        per_layer = attn + self.model_family.mlp.parameters(self) + 2 * h
        hooked = sum(math.prod(t.shape) for n in range(self.num_layers)          # they may differ per layer
                     for t in self.model_family.hooks.layer_tensors(self, n).values())
        head = h if value_head else (0 if self.tie_word_embeddings else v * h)
        return v * h + self.num_layers * per_layer + hooked + h + head

    def to_dict(self) -> dict:
        return asdict(self)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        family, arch, head = families.for_config(cfg)

        def need(key: str):
            if cfg.get(key) is None:
                raise ValueError(f"config.json: '{key}' is missing; a {arch} config must set it")
            return cfg[key]

        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported; "
                             "megarl's layer spec uses SwiGLU (silu)")
        decided = family.read(cfg, arch)
        heads = int(need("num_attention_heads"))
        kv = int(cfg.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv:
            raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv}")
        theta, scale_factor, linear_factor = _rope(cfg)
        return cls(
            architecture=arch, family=family.name, head=head,
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            ffn_hidden_size=int(need("intermediate_size")), num_layers=int(need("num_hidden_layers")),
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and head == "lm",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling_factor=scale_factor, rope_linear_factor=linear_factor,
            num_labels=int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 1)) if head == "score" else 1,
            hf_config=dict(cfg), **decided,
        )


def _rope(cfg: dict) -> tuple[float, float | None, float | None]:
    """(theta, llama3 factor, linear factor) from either transformers 5's `rope_parameters` or the
    older `rope_theta` + `rope_scaling` keys."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type", "default") != "default" else scaling
    if kind == "default":
        return theta, None, None
    if kind == "linear":
        return theta, None, float(src["factor"])
    if kind == "llama3":
        # megatron hard-codes llama3's low/high frequency factors and original context length.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(src.get(key, value)) != value:
                raise ValueError(f"config.json: rope llama3 {key}={src.get(key)} is not supported "
                                 f"(megatron-core fixes it at {value})")
        return theta, float(src.get("factor", 8.0)), None
    raise ValueError(f"config.json: rope type {kind!r} is not supported; megarl supports default, linear and llama3")


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                 world: int | None = None) -> None:
    """Refuse a (TP, PP, EP) layout that cannot shard `spec`, naming the rule. megatron puts
    expert parallelism over the data-parallel ranks, so EP must also divide DP = world / (TP x PP)
    (checked when `world` is given)."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"TP, PP and EP must be >= 1, got TP={tp} PP={pp} EP={ep}")
    if spec.num_kv_heads % tp:
        raise ValueError(f"TP={tp} must divide num_key_value_heads={spec.num_kv_heads} (each TP rank holds whole "
                         f"KV groups; KV-head replication is not supported): pick a TP that divides "
                         f"{spec.num_kv_heads}")
    if spec.num_heads % tp:
        raise ValueError(f"TP={tp} must divide num_attention_heads={spec.num_heads}")
    spec.model_family.mlp.check_tp(spec, tp)
    if spec.num_layers % pp:
        raise ValueError(f"PP={pp} must divide num_hidden_layers={spec.num_layers}: pick a divisor of "
                         f"{spec.num_layers}")
    check_experts(spec, tp, pp, ep, etp, world)


def check_experts(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                  world: int | None = None) -> None:
    """The expert-parallel part of check_layout (its messages name megarl's config keys)."""
    key = "expert_model_parallel_size"
    if not spec.is_moe:
        if ep > 1 or etp not in (None, tp):
            raise ValueError(f"{key}={ep} / expert_tensor_parallel_size={etp} need a mixture-of-experts model; "
                             f"{spec.architecture} is dense: set {key}=1 and leave expert_tensor_parallel_size null")
        return
    if etp not in (None, tp):
        raise ValueError(f"expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size={tp}; megarl "
                         "shards experts over the TP group (its conversion and weight sync assume it): leave "
                         "expert_tensor_parallel_size null or set it to the TP size")
    if spec.num_experts % ep:
        divisors = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
        raise ValueError(f"{key}={ep} does not divide num_experts={spec.num_experts}; pick one of {divisors}")
    if spec.moe_ffn_hidden_size % tp:
        raise ValueError(f"TP={tp} must divide moe_intermediate_size={spec.moe_ffn_hidden_size} (experts are "
                         "split over the TP group)")
    if spec.shared_expert_ffn % tp:
        raise ValueError(f"TP={tp} must divide shared_expert_intermediate_size={spec.shared_expert_ffn}")
    if world is not None and world % (tp * pp) == 0 and (world // (tp * pp)) % ep:
        dp = world // (tp * pp)
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and spec.num_experts % d == 0]
        raise ValueError(f"{key}={ep} must divide the data-parallel size {dp} = {world} ranks / (TP {tp} x PP {pp}) "
                         f"(megatron places experts over the DP ranks): with this TP x PP use {key} in {fits}")


def check_window(spec: ModelSpec, max_len: int, key: str = "data.max_prompt_length + data.max_response_length") -> None:
    """Mistral's sliding window: megatron's local spec (and megarl's engine) attend over the full
    causal context, which equals windowed attention only while no sequence is longer than the
    window. Refuse a run whose sequences can exceed it."""
    if spec.sliding_window and max_len > spec.sliding_window:
        raise ValueError(f"{spec.architecture} has sliding_window={spec.sliding_window} but sequences may reach "
                         f"{max_len} tokens ({key}); megarl attends over the full context, which differs past "
                         f"the window: keep {key} <= {spec.sliding_window}")


def layer_offset(spec: ModelSpec, pp_rank: int, pp: int) -> int:
    """Global index of the first layer on pipeline stage `pp_rank` (stages hold equal layer counts)."""
    return pp_rank * (spec.num_layers // pp)


def stage_layers(spec: ModelSpec, pp_rank: int, pp: int, vpp: int = 1) -> list[int]:
    """Global layers of pipeline stage `pp_rank`, chunk by chunk. With a virtual pipeline of `vpp`
    chunks, chunk v of stage p is virtual stage v*PP + p (megatron's interleaved order)."""
    per = spec.num_layers // (pp * vpp)
    return [(v * pp + pp_rank) * per + i for v in range(vpp) for i in range(per)]
