"""ModelSpec: the facts about an HF checkpoint that megarl needs to build and map its shards.

    spec = ModelSpec.from_hf_config(json.load(open("ckpt/config.json")))
    check_layout(spec, tp=2, pp=2)          # ValueError naming the rule a layout breaks

Supported: the Llama and Qwen2 families (RMSNorm, SwiGLU, RoPE with the checkpoint's theta,
GQA, QKV bias for Qwen2, tied or untied embeddings), as `*ForCausalLM` and, for critics and
reward models, `*ForSequenceClassification` (a `score` head). Anything else is refused here,
with the reason, before any rank builds a model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# model_type -> family; the families differ only in QKV bias and naming of a few config keys.
FAMILIES = {"llama": "llama", "qwen2": "qwen2"}
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"), "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForCausalLM": ("qwen2", "lm"), "Qwen2ForSequenceClassification": ("qwen2", "score"),
}
VOCAB_DIVISOR = 128  # megatron's make_vocab_size_divisible_by default


@dataclass(frozen=True)
class ModelSpec:
    architecture: str                  # e.g. "Qwen2ForCausalLM"
    family: str                        # "llama" | "qwen2"
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

    def num_parameters(self, value_head: bool = False) -> int:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        attn = self.qkv_rows * h + (self.qkv_rows if self.qkv_bias else 0) + self.num_heads * self.head_dim * h
        per_layer = attn + 3 * f * h + 2 * h
        head = h if value_head else (0 if self.tie_word_embeddings else v * h)
        return v * h + self.num_layers * per_layer + h + head

    def to_dict(self) -> dict:
        return asdict(self)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        arch = _architecture(cfg)
        family, head = ARCHITECTURES[arch]

        def need(key: str):
            if cfg.get(key) is None:
                raise ValueError(f"config.json: '{key}' is missing; a {arch} config must set it")
            return cfg[key]

        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported; "
                             "megarl's Llama/Qwen2 spec uses SwiGLU (silu)")
        if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ValueError("config.json: attention_bias/mlp_bias=true is not supported for Llama "
                             "(megatron's spec has no o_proj-only bias); use a checkpoint without them")
        if family == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported; megarl uses full causal "
                             "attention (set it to false if sequences never exceed the window)")
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise ValueError("config.json: mixture-of-experts models are not supported yet")
        heads = int(need("num_attention_heads"))
        kv = int(cfg.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv:
            raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv}")
        theta, scale_factor, linear_factor = _rope(cfg)
        return cls(
            architecture=arch, family=family, head=head,
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            ffn_hidden_size=int(need("intermediate_size")), num_layers=int(need("num_hidden_layers")),
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and head == "lm",
            qkv_bias=family == "qwen2", max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling_factor=scale_factor, rope_linear_factor=linear_factor,
            num_labels=int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 1)) if head == "score" else 1,
            hf_config=dict(cfg),
        )


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    model_type = cfg.get("model_type")
    if not archs and model_type in FAMILIES:  # configs written without `architectures`
        return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    named = ", ".join(archs) or f"model_type={model_type!r}"
    raise ValueError(f"unsupported architecture {named}; megarl supports {', '.join(sorted(ARCHITECTURES))}")


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


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """Refuse a (TP, PP) layout that cannot shard `spec`, naming the rule."""
    if tp < 1 or pp < 1:
        raise ValueError(f"TP and PP must be >= 1, got TP={tp} PP={pp}")
    if spec.num_kv_heads % tp:
        raise ValueError(f"TP={tp} must divide num_key_value_heads={spec.num_kv_heads} (each TP rank holds whole "
                         f"KV groups; KV-head replication is not supported): pick a TP that divides "
                         f"{spec.num_kv_heads}")
    if spec.num_heads % tp:
        raise ValueError(f"TP={tp} must divide num_attention_heads={spec.num_heads}")
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"TP={tp} must divide intermediate_size={spec.ffn_hidden_size}")
    if spec.num_layers % pp:
        raise ValueError(f"PP={pp} must divide num_hidden_layers={spec.num_layers}: pick a divisor of "
                         f"{spec.num_layers}")


def layer_offset(spec: ModelSpec, pp_rank: int, pp: int) -> int:
    """Global index of the first layer on pipeline stage `pp_rank` (stages hold equal layer counts)."""
    return pp_rank * (spec.num_layers // pp)


def stage_layers(spec: ModelSpec, pp_rank: int, pp: int, vpp: int = 1) -> list[int]:
    """Global layers of pipeline stage `pp_rank`, chunk by chunk. With a virtual pipeline of `vpp`
    chunks, chunk v of stage p is virtual stage v*PP + p (megatron's interleaved order)."""
    per = spec.num_layers // (pp * vpp)
    return [(v * pp + pp_rank) * per + i for v in range(vpp) for i in range(per)]
