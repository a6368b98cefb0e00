"""What a model family is: ModelFamily, and the MLP flavours (dense SwiGLU, mixture of experts)
that family files compose. Plain Python, no torch: the launcher reads families before torch loads.

    FAMILY = ModelFamily(name="qwen2", model_type="qwen2", architectures=causal_and_score("Qwen2"),
                         qkv_bias=True, refused=NO_SLIDING_WINDOW)

Everything that differs between families lives in its ModelFamily; what they share (the
attention names, the fused QKV layout, RoPE, RMSNorm, tied heads) stays in convert.py/build.py.
What data cannot say (another norm, an attention module) is code in the family's FamilyHooks
(megarl/models/families/hooks.py).
The MLP flavour owns the MLP's part of the HF <-> megatron map, its TransformerConfig keys, its
parameter and FLOP counts, so a dense and a MoE family differ by one field.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from megarl.models.families.hooks import NO_HOOKS, FamilyHooks, HookTensor, LayerTensors


class ModelSpec(Protocol):
    """The ModelSpec fields an MLP flavour reads (spec.py imports this package, so not the class)."""
    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    moe_ffn_hidden_size: int
    moe_topk: int
    moe_norm_topk: bool
    shared_expert_ffn: int
    aux_loss_coef: float
    z_loss_coef: float


# (kind "fc1" | "fc2", intermediate size, HF prefix under model.layers.N.) of one SwiGLU linear
Ffn = tuple[str, int, str]

# Refusals several families share: config key -> why megarl cannot honour it when set.
NO_BIAS = {"attention_bias": "megatron's spec has no o_proj-only bias; use a checkpoint without it",
           "mlp_bias": "megatron's local spec has no MLP bias; use a checkpoint without it"}
NO_SLIDING_WINDOW = {"use_sliding_window": "megarl uses full causal attention (set it to false if sequences "
                                           "never exceed the window)"}


# The shape every family's small test checkpoint starts from (its `tiny` keys and the caller's go over it).
TINY_SHAPES = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2)


def causal_and_score(prefix: str) -> dict[str, str]:
    """`{prefix}ForCausalLM` (an LM head) and `{prefix}ForSequenceClassification` (a `score` head)."""
    return {f"{prefix}ForCausalLM": "lm", f"{prefix}ForSequenceClassification": "score"}


@dataclass(frozen=True)
class DenseMlp:
    """One SwiGLU MLP per layer: gate/up fused into megatron's linear_fc1, down as linear_fc2."""

    def read(self, cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise ValueError(f"config.json: {arch} with experts (num_experts) is not supported; megarl's MoE "
                             "covers Qwen3MoeForCausalLM and Qwen2MoeForCausalLM")
        return {}

    def megatron_names(self, spec: ModelSpec, p: str, experts: range | None) -> list[str]:
        return [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]

    def hf_shapes(self, spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
        return _swiglu_shapes(p + "mlp.", spec.ffn_hidden_size, spec.hidden_size)

    def ffn(self, rest: str, spec: ModelSpec) -> Ffn | None:
        if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            return rest[11:14], spec.ffn_hidden_size, "mlp."
        return None

    def replicated(self, spec: ModelSpec) -> LayerTensors:
        return {}

    def transformer_config(self, spec: ModelSpec, tp: int, ep: int, etp: int | None,
                           routing_replay: bool) -> dict[str, Any]:
        return {}

    def check_tp(self, spec: ModelSpec, tp: int) -> None:
        if spec.ffn_hidden_size % tp:
            raise ValueError(f"TP={tp} must divide intermediate_size={spec.ffn_hidden_size}")

    def parameters(self, spec: ModelSpec) -> int:
        return 3 * spec.ffn_hidden_size * spec.hidden_size

    def matmul_params(self, spec: ModelSpec) -> int:
        return 3 * spec.hidden_size * spec.ffn_hidden_size            # gate, up, down


@dataclass(frozen=True)
class MoeMlp:
    """Every layer a mixture of experts: a softmax top-k router and SwiGLU experts, optionally a
    shared expert beside them whose output a sigmoid gate scales (Qwen2-MoE)."""
    shared_expert: bool = False

    def read(self, cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """The MoE fields of ModelSpec."""
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (an alias of num_experts).
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        topk = int(cfg.get("num_experts_per_tok") or 0)
        if experts < 1 or not 1 <= topk <= experts:
            raise ValueError(f"config.json: num_experts={experts}, num_experts_per_tok={topk}: a MoE config needs "
                             "1 <= num_experts_per_tok <= num_experts")
        # megatron builds one layer spec for every layer; dense layers between MoE ones would need a
        # per-layer spec and a second conversion map.
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise ValueError("config.json: mlp_only_layers / decoder_sparse_step != 1 (dense layers between MoE "
                             "layers) is not supported; megarl needs every layer to be a MoE layer")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if self.shared_expert else 0
        return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                    moe_norm_topk=bool(cfg.get("norm_topk_prob", False)), shared_expert_ffn=shared,
                    aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0),
                    z_loss_coef=float(cfg.get("router_z_loss_coef") or 0.0))

    def megatron_names(self, spec: ModelSpec, p: str, experts: range | None) -> list[str]:
        """`experts`: the global experts an expert-parallel rank holds (None: all)."""
        names = [p + "mlp.router.weight"]
        for e in (range(spec.num_experts) if experts is None else experts):
            names += [f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight",
                      f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"]
        if spec.shared_expert_ffn:
            names += [p + "mlp.shared_experts.gate_weight", p + "mlp.shared_experts.linear_fc1.weight",
                      p + "mlp.shared_experts.linear_fc2.weight"]
        return names

    def hf_shapes(self, spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
        h = spec.hidden_size
        out: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (spec.num_experts, h)}
        for e in range(spec.num_experts):
            out.update(_swiglu_shapes(f"{p}mlp.experts.{e}.", spec.moe_ffn_hidden_size, h))
        if spec.shared_expert_ffn:
            out.update(_swiglu_shapes(p + "mlp.shared_expert.", spec.shared_expert_ffn, h))
            out[p + "mlp.shared_expert_gate.weight"] = (1, h)
        return out

    def ffn(self, rest: str, spec: ModelSpec) -> Ffn | None:
        if rest.startswith("mlp.experts.local_experts."):
            e, leaf = rest[len("mlp.experts.local_experts."):].split(".", 1)
            if leaf in ("linear_fc1.weight", "linear_fc2.weight"):
                return leaf[7:10], spec.moe_ffn_hidden_size, f"mlp.experts.{e}."
        if spec.shared_expert_ffn and rest in ("mlp.shared_experts.linear_fc1.weight",
                                               "mlp.shared_experts.linear_fc2.weight"):
            return rest[26:29], spec.shared_expert_ffn, "mlp.shared_expert."
        return None

    def replicated(self, spec: ModelSpec) -> LayerTensors:
        """megatron suffix -> (HF suffix, shape) of the MLP tensors every TP rank holds whole."""
        out: LayerTensors = {"mlp.router.weight": HookTensor("mlp.gate.weight", (spec.num_experts, spec.hidden_size))}
        if spec.shared_expert_ffn:
            out["mlp.shared_experts.gate_weight"] = HookTensor("mlp.shared_expert_gate.weight", (1, spec.hidden_size))
        return out

    def transformer_config(self, spec: ModelSpec, tp: int, ep: int, etp: int | None,
                           routing_replay: bool) -> dict[str, Any]:
        """TransformerConfig keys, as the HF config says. HF's softmax router with
        norm_topk_prob=true (softmax over the top-k logits) is megatron's default; false (softmax
        over all experts, top-k of those probabilities unnormalised) is its pre-softmax routing.
        The aux loss is megatron's per-layer switch load-balancing loss with the HF coefficient (HF
        computes one loss over all layers' router outputs; megatron sums per-layer losses). No
        token dropping (capacity None), as in HF. The all-gather dispatcher runs on gloo and NCCL
        alike (megatron's all-to-all one creates a CUDA stream at build); override_transformer_config
        can pick another on GPUs. `routing_replay` gives every router megatron's RouterReplay
        (megarl/workers/routes.py drives it; unused, it routes as without)."""
        return dict(
            num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_topk, moe_router_pre_softmax=not spec.moe_norm_topk,
            moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=spec.aux_loss_coef, moe_z_loss_coeff=spec.z_loss_coef or None,
            moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
            moe_shared_expert_intermediate_size=spec.shared_expert_ffn or None,
            moe_shared_expert_gate=bool(spec.shared_expert_ffn), moe_permute_fusion=False,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
            moe_enable_routing_replay=routing_replay)

    def check_tp(self, spec: ModelSpec, tp: int) -> None:
        """Nothing here: check_experts (spec.py) checks the expert sizes against TP with EP."""

    def parameters(self, spec: ModelSpec) -> int:
        h = spec.hidden_size
        out = spec.num_experts * (3 * spec.moe_ffn_hidden_size * h + h) + 3 * spec.shared_expert_ffn * h
        return out + (h if spec.shared_expert_ffn else 0)

    def matmul_params(self, spec: ModelSpec) -> int:
        """A token meets its top-k experts, the shared one and the router."""
        h = spec.hidden_size
        return 3 * h * (spec.moe_topk * spec.moe_ffn_hidden_size + spec.shared_expert_ffn) + h * spec.num_experts


Mlp = DenseMlp | MoeMlp


def _swiglu_shapes(q: str, ffn: int, h: int) -> dict[str, tuple[int, ...]]:
    return {q + "gate_proj.weight": (ffn, h), q + "up_proj.weight": (ffn, h), q + "down_proj.weight": (h, ffn)}


@dataclass(frozen=True)
class ModelFamily:
    """One family of HF checkpoints megarl builds, maps and generates with."""
    name: str                                  # ModelSpec.family; megarl.models.tiny's --family
    model_type: str                            # the HF config's model_type it claims
    architectures: Mapping[str, str]           # HF architecture -> its head: "lm" or "score"
    qkv_bias: bool = False                     # q/k/v projections carry a bias (megatron's add_qkv_bias)
    sliding_window: bool = False               # reads `sliding_window` (refused where it could bind)
    mlp: Mlp = field(default_factory=DenseMlp)
    refused: Mapping[str, str] = field(default_factory=dict)  # config key -> why it is refused when set
    tiny: Mapping[str, Any] = field(default_factory=dict)     # config keys of a small test checkpoint
    hooks: FamilyHooks = NO_HOOKS              # code where the fields above cannot say it (hooks.py)

    @property
    def default_architecture(self) -> str:
        """What a config written without `architectures` is (the first, a causal LM)."""
        return next(iter(self.architectures))

    def read(self, cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """The ModelSpec fields this family decides, after its refusals (each one line)."""
        for key, why in self.refused.items():
            if cfg.get(key):
                raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported for {arch}: {why}")
        window = cfg.get("sliding_window") if self.sliding_window else None
        return dict(qkv_bias=self.qkv_bias, sliding_window=int(window) if window else None,
                    **self.mlp.read(cfg, arch))

    def tiny_config(self, score_head: bool = False, **overrides: Any) -> dict[str, Any]:
        """config.json of a small test checkpoint, from this description alone (no transformers):
        TINY_SHAPES, then the family's `tiny` keys, then `overrides`. `score_head`: its
        *ForSequenceClassification with one label."""
        want = "score" if score_head else "lm"
        arch = next((a for a, head in self.architectures.items() if head == want), None)
        if arch is None:
            raise ValueError(f"model family {self.name!r} has no {want} architecture")
        cfg: dict[str, Any] = {**TINY_SHAPES, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
                               "eos_token_id": 2, **self.tiny, **overrides}
        # Some configs (Qwen3's) default head_dim to 128 whatever the hidden size.
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        if score_head:
            cfg["num_labels"] = 1
        return {"model_type": self.model_type, "architectures": [arch], **cfg}
