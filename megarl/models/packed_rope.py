"""RoPE over packed (THD) sequences with one gather instead of megatron's loop over sequences.

    packed_rope.install()     # once per process, before a forward over packed rows (build_gpt does it)

megatron-core 0.16.1's unfused THD path (`rope_utils._apply_rotary_pos_emb_thd`, used without
Transformer Engine's fused RoPE, so on every CPU run and on GPUs without TE) reads cu_seqlens to
the host and slices the frequency table once per sequence, for q and for k in every layer: an RL
micro-batch of 128 short samples pays 256 slices and two `cat`s per layer (each op through the CPU
shim's TorchFunctionMode), and on GPU a device sync per call. Toggled in one process, alternating
(0.4M quickstart model, micro-batch 128, 1 thread): the update took 0.87x and 0.97x, the forward
pass 0.86x and 0.93x of megatron's loop in two runs. The slices it concatenates are rows
of the table, so one index tensor gives the same rows:
  * the table covers the sequence's own positions (its length is not the packed length): a
    token's row is its position inside its sequence;
  * the table has one row per packed token (megatron's "exact mapping"): row i is token i.
The rotation itself is megatron's own `_apply_rotary_pos_emb_bshd`, as in megatron's function,
so results are bit-identical (tests/test_models.py checks against megatron's loop).

Replaced only where megatron's function is the 0.16.1 source this was written against (its AST
fingerprint) and only for context-parallel size 1; anything else calls megatron's own.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from megarl.models.mcore import fingerprint

CHECKED = "89ed40c378b53774"      # megatron-core 0.16.1's _apply_rotary_pos_emb_thd
_MEGATRON = rope_utils._apply_rotary_pos_emb_thd


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: each packed token's position inside its own sequence."""
    cu = cu_seqlens.to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
              cp_group=None):
    """Drop-in for megatron's `_apply_rotary_pos_emb_thd` (same arguments, same result)."""
    if cp_group is None or cp_group.size() != 1:
        return _MEGATRON(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    total = t.size(0)
    if cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != total:   # megatron's split would raise
        raise ValueError(f"packed RoPE: cu_seqlens ends at {int(cu_seqlens[-1])} but the tensor has {total} tokens")
    if freqs.size(0) == total:          # one row per packed token: megatron's offset mapping
        packed = freqs[:total]
    else:
        packed = freqs[packed_positions(cu_seqlens, total)]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                  multi_latent_attention=multi_latent_attention,
                                                  mscale=mscale).squeeze(1)


def install() -> bool:
    """Route megatron's unfused THD RoPE through apply_thd; False (megatron's own kept) where the
    function is not the source this was checked against."""
    if rope_utils._apply_rotary_pos_emb_thd is apply_thd:
        return True
    if fingerprint(_MEGATRON) != CHECKED:
        return False
    rope_utils._apply_rotary_pos_emb_thd = apply_thd
    return True
