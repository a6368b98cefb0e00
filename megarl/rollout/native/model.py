"""The built-in engine's decoder for every registered family (megarl/models/families/ says which
blocks it has): RMSNorm, SwiGLU, RoPE (default, linear, llama3 scaling), GQA, optional QKV /
output bias, dense or MoE MLP, tied or untied embeddings, and what a family's hooks add (Qwen3's
per-head q/k norm: `native_qk` between the QKV projection and RoPE). The model holds only this
rank's shard (sizes come from `ModelArgs.local(...)`); the two collectives it needs arrive as a
`comm` object (megarl/rollout/native/tp.py), so no process-group code lives here.

Two entry points share the layers: `prefill` (N right-padded prompts in one pass, causal, each
prompt's K/V written once, into its group of the cache) and `decode` (one new token for each of
B rows, attending to its group's prompt and to its own generated tokens; static shapes, so the
engine can capture it in a CUDA graph; its attention: megarl/rollout/native/attention.py);
`prefill_rows` writes the responses so far of continued samples into their rows, beside prompts
already in their groups (a partial rollout resumed without a prefill of its prompt per sample).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models import families
from megarl.rollout.native.attention import MASKED, DecodeMeta, attend_shared
from megarl.rollout.native.moe import MoE

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class Comm(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    rope_scaling: tuple = ()               # sorted (key, value) pairs of the HF rope parameters
    qkv_bias: bool = False
    o_bias: bool = False
    family: str = "llama"                  # its registered family, whose hooks the layers call
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    sliding_window: int | None = None      # Mistral: positions past it are refused (full attention here)
    num_experts: int = 0                   # MoE (Qwen3-MoE, Qwen2-MoE): megarl/rollout/native/moe.py
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """HF config.json (transformers 4 or 5 spelling) -> args; unsupported features refused."""
        mtype = str(cfg.get("model_type"))
        family = families.for_model_type(mtype)
        if family is None:
            supported = ", ".join(families.get(n).model_type for n in families.names())
            raise ValueError(f"native rollout engine: model_type={mtype!r} is not supported "
                             f"(supported: {supported}); use rollout.name=hf or trtllm")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"native rollout engine: hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("use_sliding_window"):
            raise ValueError("native rollout engine: sliding-window attention is not supported; use rollout.name=hf")
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise ValueError("native rollout engine: dense layers between MoE layers (mlp_only_layers, "
                             "decoder_sparse_step) are not supported; use rollout.name=hf")
        if cfg.get("mlp_bias"):
            raise ValueError("native rollout engine: mlp_bias=true is not supported; use rollout.name=hf")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"native rollout engine: rope_type={rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); use rollout.name=hf")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("native rollout engine: partial_rotary_factor != 1 is not supported")
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        moe = family.mlp.read(cfg, mtype)      # the MoE fields ({} for a dense family)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=tuple(sorted(rope.items())),
            qkv_bias=family.qkv_bias or bias, o_bias=bias and not family.qkv_bias, family=family.name,
            sliding_window=(cfg.get("sliding_window") or None) if family.sliding_window else None,
            num_experts=moe.get("num_experts", 0), num_experts_per_tok=moe.get("moe_topk", 0),
            moe_intermediate_size=moe.get("moe_ffn_hidden_size", 0),
            norm_topk_prob=moe.get("moe_norm_topk", False),
            shared_intermediate_size=moe.get("shared_expert_ffn", 0),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768))


    @property
    def hooks(self) -> families.FamilyHooks:
        return families.get(self.family).hooks


@dataclass(frozen=True)
class LocalSizes:
    """What one TP rank holds. KV heads are split when there are at least as many as ranks,
    else replicated (rank r holds head r // (T / n_kv))."""
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int                             # rows of this rank's vocabulary shard (padded vocab / T)

    @classmethod
    def of(cls, a: ModelArgs, tp: int) -> "LocalSizes":
        if a.n_heads % tp:
            raise ValueError(f"rollout TP={tp} must divide num_attention_heads={a.n_heads}")
        if a.intermediate_size % tp:
            raise ValueError(f"rollout TP={tp} must divide intermediate_size={a.intermediate_size}")
        if a.n_kv_heads % tp and tp % a.n_kv_heads:
            raise ValueError(f"rollout TP={tp} and num_key_value_heads={a.n_kv_heads}: one must divide the other")
        # Under TP the vocabulary is padded to a multiple of lcm(128, TP), as megatron-core (and
        # megarl's trainer) pad it: the trainer's vocab shards then line up with these, so a
        # weight sync at equal TP sends each rank its own rows without gathering the embedding.
        unit = 128 * tp // math.gcd(128, tp) if tp > 1 else 1
        return cls(a.n_heads // tp, max(1, a.n_kv_heads // tp), a.intermediate_size // tp,
                   -(-a.vocab_size // unit) * unit // tp)


def rope_inv_freq(a: ModelArgs) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (so positions agree bit for bit)."""
    dim = a.head_dim
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = dict(a.rope_scaling)
    kind = p.get("rope_type", "default")
    if kind == "linear":
        inv = inv / p["factor"]
    elif kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        inv = torch.where(medium, blended, scaled)
    return inv


def rope_table(a: ModelArgs, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * rope_inv_freq(a)[None, :]  # [L, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)                                                # [L, hd]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, hd]; cos/sin [..., T, 1, hd] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def hook_part(shape: tuple[int, ...], split: int | None, tp: int) -> tuple[int, ...]:
    """The shape of one TP rank's part of a family hook's tensor (whole when split is None)."""
    if split is not None and shape[split] % tp:
        raise ValueError(f"rollout TP={tp} must divide dim {split} of a family hook's tensor {shape}")
    return tuple(x // tp if d == split else x for d, x in enumerate(shape))


class Layer(nn.Module):
    def __init__(self, a: ModelArgs, s: LocalSizes, dtype, device, index: int = 0):
        super().__init__()
        hd, h = a.head_dim, a.hidden_size
        q_rows, kv_rows = s.heads * hd, s.kv_heads * hd
        e = dict(dtype=dtype, device=device)
        self.attn_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.wqkv = nn.Parameter(torch.empty(q_rows + 2 * kv_rows, h, **e), requires_grad=False)
        self.bqkv = nn.Parameter(torch.empty(q_rows + 2 * kv_rows, **e), requires_grad=False) if a.qkv_bias else None
        # the family hooks' tensors of this layer (whole, or this rank's part), keyed by HF suffix ('.' -> '_')
        hooked, tp = a.hooks.layer_tensors(a, index).values(), a.n_heads // s.heads
        self.hooks, self.index, self.hook_keys = a.hooks, index, {t.hf: t.hf.replace(".", "_") for t in hooked}
        self.extra = nn.ParameterDict({
            self.hook_keys[t.hf]: nn.Parameter(torch.empty(hook_part(t.shape, t.split, tp), **e), requires_grad=False)
            for t in hooked})
        self.norm_fn = functools.partial(rms_norm, eps=a.rms_eps)
        self.wo = nn.Parameter(torch.empty(h, q_rows, **e), requires_grad=False)
        self.bo = nn.Parameter(torch.empty(h, **e), requires_grad=False) if a.o_bias else None
        self.mlp_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.moe = MoE(a, a.n_heads // s.heads, dtype, device) if a.num_experts else None
        dense = self.moe is None
        self.w13 = nn.Parameter(torch.empty(2 * s.intermediate, h, **e), requires_grad=False) if dense else None
        self.w2 = nn.Parameter(torch.empty(h, s.intermediate, **e), requires_grad=False) if dense else None
        self.a, self.s = a, s

    def _qkv(self, x, cos, sin):
        """x [N, T, h] -> q [N, T, hq, hd], k/v [N, T, hkv, hd] with RoPE applied."""
        s, hd = self.s, self.a.head_dim
        qkv = F.linear(x, self.wqkv, self.bqkv)
        q, k, v = qkv.split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
        q = q.unflatten(-1, (s.heads, hd))
        k = k.unflatten(-1, (s.kv_heads, hd))
        v = v.unflatten(-1, (s.kv_heads, hd))
        weights = {hf: self.extra[key] for hf, key in self.hook_keys.items()}
        q, k = self.hooks.native_qk(q, k, weights, self.norm_fn, self.index)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, attn, x, comm, ids_out=None):
        o = comm.all_reduce(F.linear(attn, self.wo))
        if self.bo is not None:
            o = o + self.bo                 # row-parallel bias: added once, after the reduction
        x = x + o
        hn = rms_norm(x, self.mlp_norm, self.a.rms_eps)
        if self.moe is not None:            # a TP-partial sum, like the dense MLP's
            return x + comm.all_reduce(self.moe(hn, ids_out))
        assert self.w13 is not None and self.w2 is not None     # a dense layer's
        g, u = F.linear(hn, self.w13).chunk(2, dim=-1)
        return x + comm.all_reduce(F.linear(F.silu(g) * u, self.w2))

    def prefill(self, x, cos, sin, pk, pv, groups, comm, ids_out=None):
        """x [N, P, h]: N prompts, right-padded; pk/pv [G, hkv, Lp, hd]: prompt n's K/V go to
        group groups[n] at [:P], once for all its samples.
        Right padding keeps plain causal attention exact for the real positions (pads come after
        them), so SDPA runs without a mask and may pick its flash / memory-efficient kernels."""
        q, k, v = self._qkv(rms_norm(x, self.attn_norm, self.a.rms_eps), cos, sin)
        P = x.shape[1]
        k, v = k.transpose(1, 2), v.transpose(1, 2)                                       # [N, hkv, P, hd]
        pk[groups, :, :P] = k
        pv[groups, :, :P] = v
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                              enable_gqa=True)                              # [N, hq, P, hd]
        return self._out(attn.transpose(1, 2).flatten(2), x, comm, ids_out)

    def prefill_rows(self, x, cos, sin, pk, pv, ck, cv, rows, grp, seen, comm):
        """x [M, L, h]: the responses so far of M continued samples, right-padded; their K/V go to
        ck/cv[rows, :, :L], the generated part, and each attends to its group's prompt K/V
        (pk/pv[grp]) and causally to its own tokens, as the decode steps that made them did.
        seen [M, 1, L, Lp + L]: True where a query sees a key."""
        q, k, v = self._qkv(rms_norm(x, self.attn_norm, self.a.rms_eps), cos, sin)
        L, Lp = x.shape[1], seen.shape[-1] - x.shape[1]
        k, v = k.transpose(1, 2), v.transpose(1, 2)                                       # [M, hkv, L, hd]
        ck[rows, :, :L] = k
        cv[rows, :, :L] = v
        keys = torch.cat([pk[grp, :, :Lp], k], dim=2)                                     # [M, hkv, Lp + L, hd]
        values = torch.cat([pv[grp, :, :Lp], v], dim=2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=seen,
                                              enable_gqa=True)                              # [M, hq, L, hd]
        return self._out(attn.transpose(1, 2).flatten(2), x, comm)

    def decode(self, x, cos, sin, pk, pv, ck, cv, m: "DecodeMeta", comm, ids_out=None):
        """x [B, 1, h]: one new token per row; pk/pv [G, hkv, Lp, hd] the prompt groups, ck/cv
        [R, hkv, Lg, hd] the rows' generated tokens. The new K/V go to ck/cv[row, :, m.spos]."""
        s, hd = self.s, self.a.head_dim
        q, k, v = self._qkv(rms_norm(x, self.attn_norm, self.a.rms_eps), cos, sin)
        ck[m.rows, :, m.spos] = k[:, 0]
        cv[m.rows, :, m.spos] = v[:, 0]
        B, g = x.shape[0], s.heads // s.kv_heads
        # Grouped-query attention without copying K/V per query head: the g query heads that
        # share a KV head become g query rows of that head.
        qr = q.view(B, s.kv_heads, g, hd)                                                 # [B, hkv, g, hd]
        attn = attend_shared(qr, pk, pv, ck, cv, m)
        return self._out(attn.to(x.dtype).reshape(B, 1, s.heads * hd), x, comm, ids_out)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs, tp_size: int, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.a, self.s = a, LocalSizes.of(a, tp_size)
        e = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.zeros(self.s.vocab, a.hidden_size, **e), requires_grad=False)
        self.blocks = [Layer(a, self.s, dtype, device, i) for i in range(a.n_layers)]   # typed, for the loops
        self.layers = nn.ModuleList(self.blocks)                                       # the same modules
        self.norm = nn.Parameter(torch.empty(a.hidden_size, **e), requires_grad=False)
        self.lm_head = (None if a.tie_embeddings else
                        nn.Parameter(torch.zeros(self.s.vocab, a.hidden_size, **e), requires_grad=False))
        self.dtype, self.device = dtype, torch.device(device)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < length:
            self._rope = rope_table(self.a, max(length, 256), self.device, self.dtype)
        return self._rope

    def embed_tokens(self, ids: torch.Tensor, comm: Comm) -> torch.Tensor:
        """Vocab-parallel lookup: each rank looks up the ids in its shard, zeros the rest, all-reduce."""
        if comm.size == 1:
            return F.embedding(ids, self.embed)
        lo = comm.rank * self.s.vocab
        local = ids - lo
        outside = (local < 0) | (local >= self.s.vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return comm.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, h: torch.Tensor, comm: Comm) -> torch.Tensor:
        """h [..., hidden] -> full-vocabulary fp32 logits [..., V] (the shards gathered)."""
        w = self.embed if self.lm_head is None else self.lm_head
        local = F.linear(rms_norm(h, self.norm, self.a.rms_eps), w).float()
        full = local if comm.size == 1 else comm.all_gather_last(local)
        return full[..., :self.a.vocab_size]

    def _check_window(self, length: int) -> None:
        """Mistral's sliding window: attention here is over the full context, equal to windowed
        attention only up to the window; refuse longer sequences rather than answer differently."""
        if self.a.sliding_window and length > self.a.sliding_window:
            raise ValueError(f"native rollout engine: a sequence of {length} tokens exceeds the model's "
                             f"sliding_window={self.a.sliding_window}, which this engine does not implement; "
                             "keep prompt + response lengths within it or use rollout.name=hf")

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, cache, groups: torch.Tensor,
                comm: Comm, routes: torch.Tensor | None = None) -> torch.Tensor:
        """ids [N, P] right-padded prompts of `lengths` [N] -> logits of each last real position
        [N, V]; prompt i's K/V land in group groups[i]; routes [N, P, layers, k]: R3's record."""
        N, P = ids.shape
        self._check_window(P)
        cos, sin = self.rope(P)
        cos, sin = cos[:P, None], sin[:P, None]                                          # [P, 1, hd]
        x = self.embed_tokens(ids, comm)                                                 # [N, P, h]
        for i, layer in enumerate(self.blocks):
            x = layer.prefill(x, cos, sin, cache.pk[i], cache.pv[i], groups, comm,
                              None if routes is None else routes[:, :, i])
        last = x[torch.arange(N, device=ids.device), lengths - 1]                        # [N, h]
        return self.logits(last, comm)

    @torch.inference_mode()
    def prefill_rows(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, grp: torch.Tensor,
                     glen: torch.Tensor, Lp: int, cache, comm: Comm) -> torch.Tensor:
        """ids [M, L]: the responses so far of M samples continued in rows `rows` [M], right-padded
        to L, `lengths` [M] >= 1 real; their prompts are already in groups grp [M] of lengths glen
        [M], Lp >= the longest -> logits of each last real token [M, V] (what the next token is
        sampled from). A partial rollout resumes this way without prefilling its prompt per sample."""
        M, L = ids.shape
        dev = ids.device
        pos = glen[:, None] + torch.arange(L, device=dev)[None, :]                       # [M, L]
        self._check_window(Lp + L)
        cos, sin = self.rope(cache.prompt_len + cache.gen_len)
        cos, sin = cos[pos][:, :, None], sin[pos][:, :, None]                            # [M, L, 1, hd]
        seen_p = torch.arange(Lp, device=dev)[None, None, :] < glen[:, None, None]       # [M, 1, Lp]
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None]            # [1, L, L]
        seen = torch.cat([seen_p.expand(M, L, Lp), causal.expand(M, L, L)], dim=2)[:, None]   # [M, 1, L, Lp + L]
        x = self.embed_tokens(ids, comm)                                                 # [M, L, h]
        for i, layer in enumerate(self.blocks):
            x = layer.prefill_rows(x, cos, sin, cache.pk[i], cache.pv[i], cache.k[i], cache.v[i], rows, grp,
                                   seen, comm)
        last = x[torch.arange(M, device=dev), lengths - 1]                               # [M, h]
        return self.logits(last, comm)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor, step: torch.Tensor, grp: torch.Tensor,
               member: torch.Tensor, glen: torch.Tensor, cache, comm: Comm, shape: tuple,
               routes: torch.Tensor | None = None) -> torch.Tensor:
        """One new token for rows 0..B-1 -> logits [B, V]. ids/pos/step/grp/member [B]: the row's
        last token, its position, tokens generated so far (the new K/V goes to step - 1), its
        group (-1: parked) and sample index; glen [>= G] the groups' prompt lengths; shape =
        (G groups, n samples per group, Lp prompt keys, Ls generated keys) to attend over;
        routes [B, layers, k]: R3's record of each row's expert ids (megarl/rollout/native/routes.py).
        Shapes depend on (B, shape) only and nothing is read back to the host: capturable."""
        G, n, Lp, Ls = shape
        B, dev = ids.shape[0], ids.device
        cos, sin = self.rope(cache.prompt_len + cache.gen_len)
        pos = pos.clamp(max=cos.shape[0] - 1)                                            # parked rows drift
        cos, sin = cos[pos][:, None, None], sin[pos][:, None, None]                      # [B, 1, 1, hd]
        spos = (step - 1).clamp(min=0, max=Ls - 1)
        # Parked rows (group -1) write to a spare slot G*n, dropped.
        slot = torch.where(grp < 0, G * n, grp * n + member)
        inv = torch.zeros(G * n + 1, dtype=torch.long, device=dev).scatter_(0, slot, torch.arange(B, device=dev))
        zero = torch.zeros((), device=dev)
        seen_p = torch.arange(Lp, device=dev)[None, :] < glen[:G, None]                  # [G, Lp]
        seen_s = torch.arange(Ls, device=dev)[None, :] <= spos[:, None]                  # [B, Ls]
        meta = DecodeMeta(rows=torch.arange(B, device=dev), spos=spos, grp_out=grp.clamp(min=0, max=G - 1),
                          member=member, inv=inv[:G * n], pbias=torch.where(seen_p, zero, MASKED)[:, None, None],
                          sbias=torch.where(seen_s, zero, MASKED)[:, None, None], G=G, n=n, Lp=Lp, Ls=Ls)
        x = self.embed_tokens(ids[:, None], comm)                                        # [B, 1, h]
        for i, layer in enumerate(self.blocks):
            x = layer.decode(x, cos, sin, cache.pk[i], cache.pv[i], cache.k[i], cache.v[i], meta, comm,
                             None if routes is None else routes[:, None, i])
        return self.logits(x[:, 0], comm)
