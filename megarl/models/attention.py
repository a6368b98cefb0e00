"""Core attention for megarl's layer spec, on `torch.nn.functional.scaled_dot_product_attention`.

Megatron's own `DotProductAttention` takes a scratch buffer on the CUDA device and is slower
than SDPA on both devices (SDPA picks flash / memory-efficient kernels on GPU). megarl never
pads inside a sequence (megarl/protocol.py: right padding only), so plain causal attention
is exact for every real token and no mask tensor is needed. Packed sequences (THD, megatron's
PackedSeqParams) go to megarl/models/varlen.py: causal attention within each sequence.
"""
from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megarl.models.varlen import varlen_causal


class SDPACoreAttention(MegatronModule):
    """[s, b, heads, hn] query and [s, b, kv_heads, hn] key/value in, [s, b, heads*hn] out.
    Heads are whatever this tensor-parallel rank holds; GQA repeats each KV head over its
    query heads."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal attention only, got {attn_mask_type}")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no attention bias")
        if packed_seq_params is not None:  # THD: query [t, heads, hn]; megatron reshapes the output
            p = packed_seq_params
            return varlen_causal(query, key, value, p.cu_seqlens_q, p.max_seqlen_q, self.softmax_scale,
                                 self.dropout if self.training else 0.0)
        groups = query.shape[2] // key.shape[2]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads*hn]
