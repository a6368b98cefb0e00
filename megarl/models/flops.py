"""Model FLOPs of a decoder-only transformer from its shape and the real sequence lengths.

    fwd = forward_flops(spec, seq_lens=[37, 120, 64])              # one forward, LM head included
    train = training_flops(spec, seq_lens, recompute=False)        # forward x3 (x4 with recompute)

Counted: every matmul (2 FLOPs per multiply-add) of the attention projections (GQA: K and V are
num_kv_heads wide), the gated MLP (three h x ffn matrices), the output head (vocab rows for an LM,
one row for a value head), and causal self-attention per sequence: QK^T and AV over the s(s+1)/2
(query, key) pairs a causal mask keeps, from each sequence's own length, never the padded width.
Not counted (as in Megatron-LM's and verl's estimates): norms, RoPE, softmax, biases, the
embedding lookup. Backward costs two forwards; activation recompute adds one more forward.
"""
from __future__ import annotations

from collections.abc import Iterable

from megarl.models.spec import ModelSpec


def matmul_params(spec: ModelSpec, head: str = "lm") -> int:
    """Weights each token meets in a matmul (per token, forward FLOPs = 2 x this)."""
    h, hd = spec.hidden_size, spec.head_dim
    q = spec.num_heads * hd
    kv = spec.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h                    # linear_qkv, linear_proj
    mlp = spec.model_family.mlp.matmul_params(spec)   # the family's MLP flavour (dense, or top-k experts)
    out = h * (spec.vocab_size if head == "lm" else 1)
    return spec.num_layers * (attn + mlp) + out


def attention_flops(spec: ModelSpec, seq_len: int) -> int:
    """Causal QK^T plus AV of one sequence, all layers, forward: 2 matmuls x 2 FLOPs x pairs x q width."""
    pairs = seq_len * (seq_len + 1) // 2
    return spec.num_layers * 4 * spec.num_heads * spec.head_dim * pairs


def forward_flops(spec: ModelSpec, seq_lens: Iterable[int], head: str = "lm") -> int:
    lens = [int(s) for s in seq_lens]
    return 2 * matmul_params(spec, head) * sum(lens) + sum(attention_flops(spec, s) for s in lens)


def training_flops(spec: ModelSpec, seq_lens: Iterable[int], head: str = "lm", recompute: bool = False) -> int:
    """Forward + backward (backward = 2 forwards), plus one forward again under full recompute."""
    return (4 if recompute else 3) * forward_flops(spec, seq_lens, head)
