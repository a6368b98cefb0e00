"""The arithmetic of megarl's memory plan (megarl/launcher/memory_plan.py): the bytes one rank
holds in parameters, gradient buffers and optimizer state, and the activations it stores, from a
model's spec and a role's layout. Pure: no torch, no megatron, no process groups.

    lay = Layout(tp=4, pp=2, dp=2, distributed_optimizer=True)
    static_bytes(spec, lay, pp_rank=0)            # Static(params=..., grads=..., optimizer=...)
    activation_bytes(spec, lay, tokens=8192, micro_batches=16)

Static parts follow megatron-core 0.16's layout as megarl builds it (megarl/workers/shards.py,
optim.py): DDP's grad buffer in fp32 (grad_reduce_in_fp32), one bucket per buffer
(overlap_grad_reduce off), and with the distributed optimizer the buffers padded as
`_ParamAndGradBuffer` pads them (each parameter starts at a multiple of 64 elements, each bucket
ends at a multiple of lcm(DP, 128), the shared embedding in a bucket of its own) with a param
buffer in the weights' dtype, while the fp32 master weights and Adam's two moments cover only this
DP rank's slice of each bucket. tests/test_memory_plan_exact.py checks these numbers against the
tensors a built model and optimizer hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.convert import EMBED, OUTPUT, megatron_names, shard_shape
from megarl.models.spec import ModelSpec, stage_layers

# megatron registers a layer's parameters in module order: the attention's output projection
# (built by Attention) before the fused QKV and the q/k norms (built by SelfAttention).
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                "pre_mlp_layernorm.", "mlp.")


def _module_rank(name: str) -> int:
    rest = name.split(".", 3)[3] if name.startswith("decoder.layers.") else ""
    return next((i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p)), len(_LAYER_ORDER))


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout and numeric choices, as megarl/workers/actor.py:engine_spec builds them."""
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    param_bytes: int = 2              # bf16 on CUDA; fp32 (4) on CPU
    host_step: bool = False           # torch's Adam keeps a 0-d `step` per parameter on the host (CPU runs)
    recompute: str | None = None      # None, "full" or "selective"


@dataclass
class Static:
    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


# -- parameters of one pipeline stage -------------------------------------------------------------------
def stage_parameters(spec: ModelSpec, lay: Layout, pp_rank: int, head: str = "lm",
                     ep_rank: int = 0) -> list[list[tuple[str, int, bool, bool]]]:
    """Per virtual-pipeline chunk of stage `pp_rank`: (global name, elements on this TP rank, expert
    (a separate buffer when EP > 1), shared embedding (a bucket of its own)), in megatron's order."""
    per_chunk = spec.num_layers // (lay.pp * lay.vpp)
    layers = stage_layers(spec, pp_rank, lay.pp, lay.vpp)
    per_ep = spec.num_experts // lay.ep if spec.num_experts else 0
    experts = range(ep_rank * per_ep, (ep_rank + 1) * per_ep) if spec.num_experts else None
    tied = head == "lm" and spec.tie_word_embeddings and lay.pp > 1
    out = []
    for v in range(lay.vpp):
        first, last = pp_rank == 0 and v == 0, pp_rank == lay.pp - 1 and v == lay.vpp - 1
        chunk_layers = layers[v * per_chunk:(v + 1) * per_chunk]
        names = megatron_names(spec, range(chunk_layers[0], chunk_layers[-1] + 1) if chunk_layers else range(0),
                               first, last, head, experts)
        body = sorted((n for n in names if n.startswith("decoder.layers.")),
                      key=lambda n: (int(n.split(".")[2]), _module_rank(n)))
        ordered = [n for n in names if n == EMBED] + body + [n for n in names if n not in body and n != EMBED]
        rows = []
        for n in ordered:
            numel = math.prod(shard_shape(n, spec, lay.tp, head))
            expert = lay.ep > 1 and ".mlp.experts." in n
            rows.append((n, numel, expert, tied and n in (EMBED, OUTPUT)))
        out.append(rows)
    return out


def buffer_layout(params: list[tuple[int, bool]], dp: int, distributed: bool) -> tuple[int, list, list]:
    """megatron's _ParamAndGradBuffer with no bucket size (megarl reduces gradients after the
    backward): `params` (elements, own bucket) in registration order -> (buffer elements,
    buckets [(start, end)], parameter ranges [(start, end)] in the same order)."""
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d
    bucket_div = math.lcm(dp, 128)
    start = bucket_start = 0
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int]] = [(0, 0)] * len(params)
    in_bucket = 0
    for i in range(len(params) - 1, -1, -1):          # megatron walks the parameters backwards
        numel, own = params[i]
        if distributed:
            start = pad(start, 64)
        if own and distributed and in_bucket:
            end = pad(start, bucket_div)
            buckets.append((bucket_start, end))
            start = bucket_start = end
            in_bucket = 0
        ranges[i] = (start, start + numel)
        in_bucket += 1
        if own and distributed:
            end = pad(start + numel, bucket_div)
            buckets.append((bucket_start, end))
            start = bucket_start = end
            in_bucket = 0
        else:
            start += numel
    if in_bucket:
        end = pad(start, bucket_div) if distributed else start
        buckets.append((bucket_start, end))
        start = end
    return (buckets[-1][1] if buckets else 0), buckets, ranges


def _optimizer_elements(ranges: list, buckets: list, dp: int) -> int:
    """The most parameter elements any DP rank's slice of the buckets covers (the distributed
    optimizer keeps master weights and moments for those only, padding excluded)."""
    best = 0
    for r in range(dp):
        got = 0
        for b0, b1 in buckets:
            lo, hi = b0 + (b1 - b0) // dp * r, b0 + (b1 - b0) // dp * (r + 1)
            got += sum(max(0, min(hi, e) - max(lo, s)) for s, e in ranges if b0 <= s < b1)
        best = max(best, got)
    return best


def static_bytes(spec: ModelSpec, lay: Layout, pp_rank: int, head: str = "lm", trainable: bool = True) -> Static:
    """Parameters, gradient buffers and optimizer state of one rank of stage `pp_rank` (its largest
    DP slice with the distributed optimizer)."""
    out = Static()
    moments = 8 + (4 if lay.param_bytes != 4 else 0)   # Adam's two fp32 moments (+ fp32 masters below fp32)
    world = lay.dp * lay.tp * lay.pp * lay.cp
    for chunk in stage_parameters(spec, lay, pp_rank, head):
        n_tensors = len(chunk)
        if not trainable:
            out.params += sum(n for _, n, _, _ in chunk) * lay.param_bytes
            continue
        for expert in (False, True):
            group = [(n, own) for _, n, e, own in chunk if e == expert]
            if not group:
                continue
            dp = world // (lay.pp * lay.ep * lay.tp) if expert else lay.dp * lay.cp
            numel, buckets, ranges = buffer_layout(group, dp, lay.distributed_optimizer)
            out.grads += numel * 4                                  # grad_reduce_in_fp32
            if lay.distributed_optimizer:
                out.params += numel * lay.param_bytes               # params become views of this buffer
                out.optimizer += _optimizer_elements(ranges, buckets, dp) * moments
            else:
                real = sum(n for n, _ in group)
                out.params += real * lay.param_bytes
                out.optimizer += real * moments
        if lay.host_step:
            out.optimizer += 4 * n_tensors
    return out


# -- activations ---------------------------------------------------------------------------------------
def activation_bytes(spec: ModelSpec, lay: Layout, tokens: int, micro_batches: int, act_bytes: int = 2,
                     pp_rank: int = 0) -> int:
    """Activations stored for the backward on pipeline stage `pp_rank`, for micro-batches of
    `tokens` tokens (the embedding stores none of its own at dropout 0: its output is the first
    layer's input, counted there). Per layer, the tensors Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", section 4.1) count, for megarl's layers:
    RMSNorm inputs 2*2sh, QKV input 2sh, Q/K/V 2s(h+2*kv*hn), the attention output 2sh (flash
    attention stores no s x s scores: their 5as^2 term is gone), fc1 input 2sh, SwiGLU's fc1 output
    4sf and product 2sf; no dropout masks (dropout 0). Sequence parallelism divides all of it by TP
    (without it the norm and linear inputs, 8sh, are whole on every TP rank); full recompute keeps
    only each layer's input (2sh) plus one layer's full set. 1F1B keeps min(PP - p, micro-batches)
    micro-batches in flight on stage p (the last stage one), times 1 + (PP-1)/(PP*VPP) when
    interleaved (section 4.2.3)."""
    s = tokens / lay.cp
    h, kvd = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    f = (spec.moe_ffn_hidden_size * spec.moe_topk + spec.shared_expert_ffn) if spec.is_moe else spec.ffn_hidden_size
    whole = 8 * h                                      # norms' and linears' inputs: replicated without SP
    split = 2 * (h + 2 * kvd) + 2 * h + 6 * f          # Q/K/V, attention output, SwiGLU (TP-sharded)
    per_tp = (whole + split) / lay.tp if lay.sequence_parallel else whole + split / lay.tp
    layer = s * per_tp * act_bytes / 2
    layers = len(stage_layers(spec, pp_rank, lay.pp, lay.vpp))
    if lay.recompute == "full":
        kept = s * 2 * h / (lay.tp if lay.sequence_parallel else 1) * act_bytes / 2
        stage = kept * layers + layer
    else:
        stage = layer * layers
    in_flight = float(min(lay.pp - pp_rank, micro_batches) if lay.pp > 1 else 1)
    if lay.vpp > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return int(stage * in_flight)



# -- the LM head and the loss on the last stage ---------------------------------------------------------
# megarl never holds a micro-batch's logits: its output layer hands back the hidden states
# (megarl/workers/logprob.py:hidden_to_head) and linear_log_probs projects them a chunk of tokens at
# a time, so megatron's vocab_parallel_cross_entropy and its [tokens, V/TP] buffers are never used.
LOGIT_CHUNK_BYTES = 64 << 20      # megarl/workers/logprob.py:CHUNK_BYTES (tests/test_memory_plan_logits.py)


def logit_chunk_tokens(vocab_local: int) -> int:
    """megarl/workers/logprob.py:chunk_tokens: the tokens one chunk of fp32 logits holds."""
    return max(16, LOGIT_CHUNK_BYTES // (4 * max(vocab_local, 1)))


def logits_bytes(spec: ModelSpec, lay: Layout, scored: int, head_bytes: int, temperature: float = 1.0,
                 entropy_grad: bool = False) -> int:
    """Peak bytes of one training micro-batch's LM head and loss on the last stage beyond the
    hidden states and the head weight: `scored` response tokens through _LinearLogProbs
    (megarl/workers/logprob.py), weights and hidden states of `head_bytes` each. Kept for the
    backward: the hidden states at the scored positions and 4 fp32 numbers a token (lse, E_p[z],
    log p, entropy). Forward: per chunk of c tokens, blocks Z = c x V_valid x 4 bytes: z, shifted
    and exp stay bound while the next z is made (and its fp32 cast or /T copy, `cast`), then
    exp * shifted. Backward: grad_h [scored, h] and an fp32 grad_w over the head's padded rows,
    with z, p and gz (in the weights' dtype) bound across chunks, while (z - lse).exp() or -p * g
    (2 Z), the entropy's gradient (5 Z with z, p, gz in fp32), gz / T and its cast, the chunk's
    [V_valid, h] weight gradient and its fp32 copy, or grad_w's final cast are made. Counted for
    at least two chunks (a real vocabulary: ~110 tokens a chunk at 152k); the per-token and
    per-chunk vectors (row maxima, sums, indices: under 24 bytes a chunk row and 8 a token) are not.
    tests/test_memory_plan_logits.py checks it against what torch allocates on CPU."""
    rows = spec.padded_vocab(lay.tp) // lay.tp
    valid = min(rows, spec.vocab_size)              # TP rank 0's real rows: the most of any rank
    h, p = spec.hidden_size, head_bytes
    z = min(logit_chunk_tokens(valid), scored) * valid * 4
    half = z * p // 4                               # a chunk's block in the weights' dtype
    cast = max(half + (z if p != 4 else 0), 2 * z if temperature != 1 else z)
    forward = 3 * scored * 4 + max(4 * z, 3 * z + cast)
    bound = 2 * z + half                            # z, p, gz between backward chunks
    chunk = max(bound + cast, bound + 2 * z, 5 * z if entropy_grad else 0,
                (4 * z if temperature != 1 else 3 * z) + (half if p != 4 else 0),
                bound + valid * h * p + (valid * h * 4 if p != 4 else 0), bound + (rows * h * 2 if p != 4 else 0))
    backward = 4 * scored * 4 + scored * h * p + rows * h * 4 + chunk
    return scored * h * p + max(forward, backward)
