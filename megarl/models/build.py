"""ModelSpec -> megatron-core TransformerConfig, layer spec and one pipeline stage's GPTModel.

    config = transformer_config(spec, tp=2, pp=2, dtype=torch.float32)
    model = build_gpt(spec, config, pre_process=first_stage, post_process=last_stage, head="lm")

`head="value"` swaps the LM head for a [1, h] value head (critic / reward model); its output is
[b, s, 1]. The process groups themselves come from megatron's parallel_state (megarl/parallel).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megarl.models import packed_rope
from megarl.models.attention import SDPACoreAttention
from megarl.models.context_parallel import CPCoreAttention
from megarl.models.convert import to_global, tp_dim
from megarl.models.norm import Norm, norm_class
from megarl.models.spec import ModelSpec


RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def transformer_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype = torch.float32,
                       cpu_init: bool | None = None, sequence_parallel: bool = False,
                       recompute: bool = False, overrides: dict[str, Any] | None = None,
                       cp: int = 1, vpp: int | None = None, ep: int = 1,
                       etp: int | None = None, routing_replay: bool = False) -> TransformerConfig:
    """The TransformerConfig of `spec` under (TP, PP). Weights are loaded afterwards, so megatron's
    random initialisation is skipped. `calculate_per_token_loss=True` turns off megatron's own loss
    scaling (division by micro-batch count, DDP averaging): megarl's loss functions normalise
    themselves over the whole mini-batch (see megarl/workers/engine.py)."""
    if cpu_init is None:
        cpu_init = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel and tp > 1,
        context_parallel_size=cp, virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init, perform_initialization=False,
        calculate_per_token_loss=True, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        deallocate_pipeline_outputs=False,
        # megarl builds megatron's local spec; `transformer_engine` (an override) swaps in TE's norm.
        transformer_impl="local",
    )
    if vpp and vpp > 1:
        # Under the interleaved schedule with PP=2 a stage's previous and next stage are the same
        # rank, and megatron's batched p2p then matches a forward send with a backward receive
        # (same shapes, wrong data). Its unbatched path orders the two directions apart.
        kwargs.update(batch_p2p_comm=False, overlap_p2p_comm=False)
    kwargs.update(spec.model_family.mlp.transformer_config(spec, tp, ep, etp, routing_replay))
    kwargs.update(spec.model_family.hooks.transformer_config(spec))
    overrides = dict(overrides or {})
    # verl's generated configs carry recompute_granularity/method/num_layers: null, meaning unset;
    # a null must not switch off what enable_gradient_checkpointing asked for.
    chosen = {k: overrides.pop(k) for k in RECOMPUTE_KEYS if k in overrides}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    granularity = chosen.get("recompute_granularity", "full" if recompute else None)
    if granularity == "full":        # megatron needs a method and a layer count with full recompute
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(chosen, **overrides)
    return TransformerConfig(**kwargs)


def _no_te_router_gemm() -> None:
    """megatron-core 0.16's router gating references `te_general_gemm`, which it defines only
    when Transformer Engine imports; without TE the name is missing and routing raises
    NameError. Define it as None, which selects megatron's own torch.mm path."""
    moe_utils.__dict__.setdefault("te_general_gemm", None)


def layer_spec(spec: ModelSpec, config: TransformerConfig | None = None, index: int = 0) -> ModuleSpec:
    """megatron's local (no Transformer Engine) layer spec with SDPA core attention (its
    context-parallel form when CP > 1) and megarl's norm, which supports sequence parallelism;
    megatron's MoE layer (SequentialMLP experts) for MoE models; then the family's layer_spec
    hook edits it for global layer `index` (Qwen3: q/k RMSNorm)."""
    if spec.is_moe:
        _no_te_router_gemm()
    out = get_gpt_layer_local_spec(num_experts=spec.num_experts or None, moe_grouped_gemm=False,
                                   normalization="RMSNorm")
    cp = config.context_parallel_size if config is not None else 1
    out.submodules.self_attention.submodules.core_attention = CPCoreAttention if cp > 1 else SDPACoreAttention
    norm = norm_class(config) if config is not None else Norm
    out.submodules.input_layernorm = norm
    out.submodules.pre_mlp_layernorm = norm
    spec.model_family.hooks.layer_spec(out, norm, index)
    return out


def block_spec(spec: ModelSpec, config: TransformerConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (or virtual-pipeline chunk) and the final norm: megatron
    would otherwise build the final norm with its own torch norm, which refuses SP."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    # one spec per layer: a hybrid family's hook makes layers differ (megatron reads each in order)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(spec, config, first + i) for i in range(layers)],
                                      layer_norm=norm_class(config))


class ValueHead(MegatronModule):
    """A [1, h] linear head replicated on every TP rank; called like megatron's output layer."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config=config)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype, device=device))

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            # hidden is split over TP along the sequence; every TP rank computes every value
            # (the head is replicated), so the backward keeps this rank's slice instead of summing.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None  # [s, b, 1]


def build_gpt(spec: ModelSpec, config: TransformerConfig, pre_process: bool, post_process: bool,
              head: str = "lm", vp_stage: int | None = None) -> GPTModel:
    """One pipeline stage of the model (all of it when PP=1), or with virtual pipelining one
    chunk `vp_stage` of it. The LM head's vocabulary is padded (ModelSpec.padded_vocab); padded
    logits are dropped by the log-prob code."""
    if head not in ("lm", "value"):
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    packed_rope.install()
    tie = spec.tie_word_embeddings and head == "lm"
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(spec, config, vp_stage), vp_stage=vp_stage,
        vocab_size=spec.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=tie, parallel_output=True,
        position_embedding_type="rope", rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None, rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=spec.rope_linear_factor,
    )
    if head == "value" and post_process:
        model.output_layer = ValueHead(config)
    _mark_tensor_parallel(model, head, spec, get_transformer_layer_offset(config, vp_stage=vp_stage))
    if spec.is_moe:
        _route_loss_per_micro_batch(model)
    return model


def _route_loss_per_micro_batch(model: GPTModel) -> None:
    """With calculate_per_token_loss megatron multiplies each router's aux/z loss by the
    micro-batch's token count and relies on finalize_model_grads dividing by the total; megarl's
    gradient contract drops that division (megarl/workers/engine.py). So the routers add their
    loss unscaled, and the engine sets the coefficient per mini-batch (moe_loss_scale)."""
    for m in model.modules():
        if isinstance(m, Router):
            m.calculate_per_token_loss = False


def _mark_tensor_parallel(model: GPTModel, head: str, spec: ModelSpec, offset: int) -> None:
    """megatron tags TP-split weights (`tensor_model_parallel`, `partition_dim`) only inside its
    random initialisation, which megarl skips because it loads weights; the grad norm and
    optimizers need the tags, so set them from megarl's own sharding map (a family hook's tensor by
    its declared split; `offset`: the stage's first global layer)."""
    for name, param in model.named_parameters():
        dim = tp_dim(to_global(name, offset), head, spec)
        if dim is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, True, dim, 1)
