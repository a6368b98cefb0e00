"""How one micro-batch enters the model: right-padded rows [b, s], or packed rows [1, T] (THD).

    inp = packed_input(mb, length=None)     # sequences back to back, cu_seqlens in PackedSeqParams
    inp = padded_input(mb, seq)             # today's layout: rows cut or padded to `seq` columns
    out = model(inp.input_ids, inp.position_ids, None, packed_seq_params=inp.packed_seq_params)
    picked = out.flatten(0, 1)[inp.out_index]   # [b, R, d]: outputs that predict responses[:, j]

Packed, no compute goes to padding: attention runs per sequence (megarl/models/attention.py) and
megatron's RoPE restarts positions at each cu_seqlens boundary. When a common length is asked
(pipeline stages exchange fixed shapes; sequence parallelism splits evenly) the tail is one more
segment of pad tokens, never attended by a real token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megarl.protocol import DataProto
from megarl.workers.batching import response_positions


@dataclass
class MicroInput:
    input_ids: torch.Tensor               # [b, s] or [1, T]
    position_ids: torch.Tensor            # same shape
    packed_seq_params: object | None      # megatron's PackedSeqParams (THD) or None
    out_index: torch.Tensor               # [b, R] index into the output's flattened first two dims
    last_index: torch.Tensor              # [b] the same index of each row's last real token
    computed_tokens: int                  # tokens the model runs over, padding included

    def to(self, device) -> "MicroInput":
        p = self.packed_seq_params
        if p is not None:
            cu = p.cu_seqlens_q.to(device)
            p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv)
        return MicroInput(self.input_ids.to(device), self.position_ids.to(device), p, self.out_index.to(device),
                          self.last_index.to(device), self.computed_tokens)


def padded_input(mb: DataProto, seq: int) -> MicroInput:
    """Rows right-padded (or cut) to `seq` columns."""
    ids = mb.batch["input_ids"]
    if ids.shape[1] < seq:
        ids = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]))
    ids = ids[:, :seq]
    b, dev = ids.shape[0], ids.device
    R = mb.batch["responses"].shape[1]
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(b, -1)
    base = torch.arange(b, device=dev) * seq
    index = response_positions(mb.batch["prompt_lens"], R, seq) + base.unsqueeze(1)
    last = (mb.batch["prompt_lens"] + mb.batch["response_lens"] - 1).clamp(0, seq - 1) + base
    return MicroInput(ids, pos, None, index, last, b * seq)


def packed_input(mb: DataProto, length: int | None = None) -> MicroInput:
    """The rows' real tokens back to back in one [1, T] row; T = `length` (>= the real total)
    with the tail as a separate segment of pad tokens."""
    plen, rlen = mb.batch["prompt_lens"], mb.batch["response_lens"]
    lens = (plen + rlen).clamp(min=1)
    dev = plen.device
    total = int(lens.sum())
    length = total if length is None else length
    if length < total:
        raise ValueError(f"a packed micro-batch of {total} tokens does not fit length {length}")
    ids = mb.batch["input_ids"]
    seg = lens.tolist()
    # Row-major selection of each row's first lens[i] columns: the rows back to back, in a few
    # calls rather than a slice and an arange per row (a fixed cost per sequence otherwise).
    col = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
    real = col < lens.unsqueeze(1)
    rows = [ids[real]]
    pos = [col.expand_as(ids)[real]]
    if length > total:
        rows.append(torch.zeros(length - total, dtype=ids.dtype, device=ids.device))
        pos.append(torch.arange(length - total, device=dev))
        seg.append(length - total)
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seg).cumsum(0)
    pos = torch.cat(pos)
    # megatron's THD RoPE (rope_utils._apply_rotary_pos_emb_thd) reads the table by absolute pack
    # offset when its length equals the pack's (one segment): then offset and position coincide.
    # With two or more segments max_seqlen < T, and each segment restarts at position 0.
    R = mb.batch["responses"].shape[1]
    starts = cu[:-1][:len(lens)].long().to(dev)  # cu_seqlens stays on the host until MicroInput.to
    index = starts.unsqueeze(1) + response_positions(plen, R, 1 << 62)
    # Padding columns (j >= response_lens) point inside their own row (their values are masked).
    index = torch.minimum(index, (starts + lens - 1).unsqueeze(1))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(seg), max_seqlen_kv=max(seg))
    return MicroInput(torch.cat(rows).unsqueeze(0), pos.unsqueeze(0), params, index, starts + lens - 1, length)


def widths(lengths: list[list[int]], packed: bool, seq: int, common: bool, multiple: int = 1) -> list[int]:
    """Columns of each micro-batch of a run, from its rows' lengths. Padded: `seq` when `common`
    (the pipeline's fixed shape, and today's static layout), else its own longest row. Packed:
    its own total, or the run's largest when `common`. Rounded up to `multiple` (sequence parallel)."""
    def up(n: int) -> int:
        return -(-n // multiple) * multiple

    own = [sum(ls) if packed else max(ls) for ls in lengths]
    if common:
        top = max(own) if packed else seq
        return [up(top)] * len(own)
    return [up(n) for n in own]


def computed_tokens(lengths: list[list[int]], packed: bool, seq: int, common: bool, multiple: int = 1) -> int:
    """Tokens the model computes for a run, padding included (perf/padding_ratio's numerator)."""
    cols = widths(lengths, packed, seq, common, multiple)
    return sum(c if packed else c * len(ls) for c, ls in zip(cols, lengths))


def micro_inputs(micro: list[DataProto], packed: bool, cols: list[int]) -> list[MicroInput]:
    return [packed_input(m, c) if packed else padded_input(m, c) for m, c in zip(micro, cols)]
