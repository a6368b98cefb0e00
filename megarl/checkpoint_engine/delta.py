"""Delta weight sync, the pure part: what changed since the last sync, encoded small, applied in place.

    pieces = bucket_pieces(plan, bucket, t)            # TP rank t's HF pieces of a bucket (no tensors)
    new = piece_vector(plan, bucket, t, params, dtype) # their values in the engine's dtype, one flat vector
    frame = encode(new, last, dense_above=0.25, codec="none")  # gaps / indices / xor / dense: the smallest
    idx, vals = decode(frame, new.numel(), dtype, old_at=...)  # receiver side
    apply_changes(engine, pieces, idx, vals)           # into the engine's live weights (weight_view)
    checksum(region)                                   # compared per bucket, sender vs engine

Why HF pieces: the sender diffs what it owns (its TP shard, split into the HF tensors it covers,
convert.hf_slices), and every changed element then has one place in the full HF tensor, so any
engine layout (rollout TP, engines taking full tensors) maps it into its own part with index
arithmetic, without the all-gather and conversion a full sync runs. Values travel in the engine's
dtype, cast on the sender exactly as the engine's own copy would cast them, so a delta sync leaves
the engine bit-identical to a full sync.

Checksum: two 64-bit reductions (wrapping sum and XOR) over the int64 view of the bytes, each one
pass that only reads memory (torch, any device). A single corrupted element always changes the
sum; a value landing at a wrong index changes it unless the two elements held the same bits.
xxhash would be stronger against adversaries, but is not a dependency and would need a host copy
on GPU; the threat here is a transport or indexing bug, not an adversary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.checkpoint_engine.plan import Bucket, TransferPlan, split_shard
from megarl.models.convert import Slice, hf_slices
from megarl.rollout.base import ShardSlice

INDICES, XOR, DENSE, GAPS, STEPS = 0, 1, 2, 3, 4
KINDS = {INDICES: "indices", XOR: "xor", DENSE: "dense", GAPS: "gaps", STEPS: "steps"}
CODECS = {"none": 0, "zstd": 1, "lz4": 2}


@dataclass(frozen=True)
class Piece:
    part: Slice                    # which rows/columns of which HF tensor
    shape: tuple[int, ...]         # the piece's shape
    offset: int                    # its first element in the bucket's piece vector

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def bucket_pieces(plan: TransferPlan, bucket: Bucket, t: int) -> list[Piece]:
    """TP rank t's HF pieces of `bucket`, in order. A replicated tensor comes from TP rank 0 only."""
    shapes, out, off = plan.hf_shapes(), [], 0
    for e in bucket.entries:
        for s in hf_slices(e.name, plan.spec, t, plan.tp, plan.head):
            if s.dim is None and t != 0:
                continue
            shape = list(shapes[s.hf_name])
            if s.dim is not None:
                shape[s.dim] = max(0, s.stop - s.start)
            out.append(Piece(s, tuple(shape), off))
            off += math.prod(shape)
    return out


def piece_vector(plan: TransferPlan, bucket: Bucket, t: int, params, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """TP rank t's pieces of `bucket` from its shards `params`, cast to `dtype`, as one flat vector."""
    pieces = bucket_pieces(plan, bucket, t)
    n = sum(p.numel for p in pieces)
    out = torch.empty(n, dtype=dtype, device=next(iter(params.values())).device) if out is None else out
    off = 0
    for e in bucket.entries:
        for s, tensor in split_shard(e.name, params[e.name], plan.spec, t, plan.tp, plan.head):
            if s.dim is None and t != 0:
                continue
            out[off:off + tensor.numel()].view(tensor.shape).copy_(tensor)
            off += tensor.numel()
    if off != n:
        raise RuntimeError(f"bucket {bucket.index}: pieces hold {off} elements, the plan says {n}")
    return out


# -- bit patterns ---------------------------------------------------------------------------------------
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(wrapping sum, XOR) of the int64 words of t's bytes (a trailing partial word widened)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:           # an int64 view needs 8-byte alignment
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    tail = raw[whole:].to(torch.int64)
    total = int(words.sum()) + int(tail.sum()) if tail.numel() else int(words.sum())
    xor = int(torch.hash_tensor(words).reshape(1).view(torch.int64)) if words.numel() else 0
    for k, b in enumerate(tail.tolist()):
        xor ^= b << (8 * k)
    return total & (2**64 - 1), xor & (2**64 - 1)


def combine(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (a[0] + b[0]) & (2**64 - 1), a[1] ^ b[1]


def as_signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


# -- encoding ---------------------------------------------------------------------------------------------
def _compress(data: bytes, codec: str) -> bytes:
    if codec == "zstd":
        import zstandard  # optional (megarl[compress]); DeltaOptions asked codec_problem first
        return zstandard.ZstdCompressor(level=1).compress(data)
    import lz4.frame  # optional (megarl[compress]); DeltaOptions asked codec_problem first
    return lz4.frame.compress(data)


def _decompress(data: bytes, codec: str) -> bytes:
    if codec == "zstd":
        import zstandard  # optional dependency, as in _compress
        return zstandard.ZstdDecompressor().decompress(data)
    import lz4.frame  # optional dependency, as in _compress
    return lz4.frame.decompress(data)


@dataclass
class Frame:
    kind: int                      # INDICES, XOR or DENSE
    codec: str                     # "none", "zstd", "lz4"
    payload: torch.Tensor          # uint8
    nnz: int                       # changed elements (all of them for DENSE)


def encode(new: torch.Tensor, last: torch.Tensor | None, dense_above: float, codec: str = "none") -> Frame:
    """The smallest of: the changed elements' positions (uint16 gaps between them where every gap
    fits, else int32 indices) and values, the compressed XOR of the bit patterns (with a codec),
    or the whole vector (dense: always when `last` is None or more than `dense_above` of the
    elements changed)."""
    n = new.numel()
    dense = new.reshape(-1).view(torch.uint8)
    if last is None:
        return _squeeze(Frame(DENSE, "none", dense, n), codec)
    idx = (bits(new) != bits(last)).nonzero().view(-1)
    nnz = idx.numel()
    if n == 0 or nnz > dense_above * n:
        return _squeeze(Frame(DENSE, "none", dense, nnz), codec)
    vals = new[idx].view(torch.uint8)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1 if nnz else idx
    if nnz == 0 or int(gaps.max()) < 2**16:      # gaps between changes fit 16 bits: 2 bytes an index
        gap_bytes = gaps.to(torch.int32).to(torch.int16).view(torch.uint8)
        best = Frame(GAPS, "none", torch.cat([gap_bytes, vals]), nnz)
        if new.element_size() == 2:
            # Small updates move a 16-bit pattern by a few units (ulps): one signed byte says how
            # many; -128 escapes to the whole 16-bit difference, listed after the steps.
            diff = (bits(new)[idx].to(torch.int32) - bits(last)[idx].to(torch.int32)).to(torch.int16)
            small = diff.to(torch.int32).abs() <= 127
            steps = torch.where(small, diff, torch.full_like(diff, -128)).to(torch.int8)
            payload = torch.cat([gap_bytes, steps.view(torch.uint8), diff[~small].view(torch.uint8)])
            if payload.numel() < best.payload.numel():
                best = Frame(STEPS, "none", payload, nnz)
    else:
        best = Frame(INDICES, "none", torch.cat([idx.to(torch.int32).view(torch.uint8), vals]), nnz)
    if codec != "none":
        best = _squeeze(best, codec)
        xor = (bits(new) ^ bits(last)).view(torch.uint8)
        packed = _compressed(xor, codec)
        if packed.numel() < best.payload.numel():
            best = Frame(XOR, codec, packed, nnz)
    return best


def _compressed(data: torch.Tensor, codec: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_compress(data.cpu().numpy().tobytes(), codec)), dtype=torch.uint8)


def _squeeze(frame: Frame, codec: str) -> Frame:
    """The frame compressed with `codec` where that makes it smaller."""
    if codec == "none" or frame.payload.numel() == 0:
        return frame
    packed = _compressed(frame.payload, codec)
    if packed.numel() < frame.payload.numel():
        return Frame(frame.kind, codec, packed, frame.nnz)
    return frame


def decode(kind: int, codec: str, payload: torch.Tensor, n: int, nnz: int, dtype: torch.dtype):
    """(indices int64, values) of a sparse frame, (None, all values) of a dense one,
    (indices, XOR bit patterns) of an XOR frame (the caller XORs them into the old values), or
    (indices, int16 differences) of a STEPS frame (the caller adds them to the old bit patterns)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if payload.storage_offset() % 8:      # a slice of the bucket's receive buffer: align for the views
        payload = payload.clone()
    if codec != "none":
        payload = torch.frombuffer(bytearray(_decompress(payload.cpu().numpy().tobytes(), codec)), dtype=torch.uint8)
    if kind == DENSE:
        if payload.numel() != n * size:
            raise ValueError(f"dense frame of {payload.numel()} bytes for {n} elements of {dtype}")
        return None, payload.view(dtype)
    if kind in (INDICES, GAPS, STEPS):
        width = 4 if kind == INDICES else 2
        escaped = int((payload[2 * nnz:3 * nnz].view(torch.int8) == -128).sum()) if kind == STEPS else 0
        if payload.numel() != nnz * (width + (1 if kind == STEPS else size)) + 2 * escaped:
            raise ValueError(f"sparse frame of {payload.numel()} bytes for {nnz} changes")
        if kind == INDICES:
            idx = payload[:4 * nnz].view(torch.int32).to(torch.int64)
        else:                               # gaps: uint16 stored in int16 bits
            idx = torch.cumsum((payload[:2 * nnz].view(torch.int16).to(torch.int64) & 0xFFFF) + 1, 0) - 1
        payload = payload[width * nnz:]
        if kind == STEPS:                   # 16-bit differences: the caller adds them to the old bits
            steps = payload[:nnz].view(torch.int8)
            diff = steps.to(torch.int16)
            esc = steps == -128
            rest = payload[nnz:].clone()
            diff[esc] = rest.view(torch.int16) if rest.numel() else diff[esc]
            return idx, diff
        if payload.storage_offset() % 8:
            payload = payload.clone()
        if nnz and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"sparse frame has indices outside [0, {n})")
        return idx, payload.view(dtype)
    xor = payload.view(_INT[size])
    if xor.numel() != n:
        raise ValueError(f"xor frame of {xor.numel()} elements for {n}")
    idx = (xor != 0).nonzero().view(-1)
    return idx, xor[idx]


# -- where a piece's elements live in an engine --------------------------------------------------------
def _ranges(piece: Piece, full: tuple[int, ...], want: ShardSlice) -> list[tuple[int, int]] | None:
    """Per dimension, the [start, stop) of the full tensor both the piece and the engine part
    cover; None when they do not meet."""
    out = [(0, s) for s in full]
    for dim, lo, hi in ((piece.part.dim, piece.part.start, piece.part.stop), (want.dim, want.start, want.stop)):
        if dim is not None:
            a, b = out[dim]
            out[dim] = (max(a, lo), min(b, hi))
    return out if all(a < b for a, b in out) else None


def region(t: torch.Tensor, origin: list[int], ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The view of `t` (whose element 0 sits at `origin` of the full tensor) covering `ranges`."""
    for d, ((a, b), o) in enumerate(zip(ranges, origin)):
        t = t.narrow(d, a - o, b - a)
    return t


def piece_origin(piece: Piece, full: tuple[int, ...]) -> list[int]:
    return [piece.part.start if d == piece.part.dim else 0 for d in range(len(full))]


def part_origin(want: ShardSlice, full: tuple[int, ...]) -> list[int]:
    return [want.start if d == want.dim else 0 for d in range(len(full))]


def to_part(piece: Piece, idx: torch.Tensor, full: tuple[int, ...],
            want: ShardSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """Piece-local flat indices -> (which of them the engine part holds (mask), their flat index
    in the part)."""
    lo, hi = (piece.part.start, piece.part.stop) if piece.part.dim == 0 else (0, full[0] if full else 1)
    wlo, whi = (want.start, want.stop) if want.dim == 0 else (0, full[0] if full else 1)
    if piece.part.dim in (None, 0) and want.dim in (None, 0) and wlo <= lo and hi <= whi:
        # rows of the full tensor inside the engine's rows: a constant offset (the common case)
        return torch.ones_like(idx, dtype=torch.bool), idx + (lo - wlo) * math.prod(full[1:])
    coords = list(torch.unravel_index(idx, piece.shape)) if idx.numel() else [idx for _ in piece.shape]
    if piece.part.dim is not None:
        coords[piece.part.dim] = coords[piece.part.dim] + piece.part.start
    keep = torch.ones_like(idx, dtype=torch.bool)
    part_shape = list(full)
    if want.dim is not None:
        c = coords[want.dim]
        keep &= (c >= want.start) & (c < want.stop)
        coords[want.dim] = c - want.start
        part_shape[want.dim] = want.stop - want.start
    flat = torch.zeros_like(idx)
    for c, size in zip(coords, part_shape):
        flat = flat * size + c
    return keep, flat[keep]


def updated(kind: int, old: torch.Tensor, vals: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The new values at decoded positions, from the old ones there where the frame needs them."""
    if kind == XOR:
        return (bits(old) ^ vals).view(dtype)
    if kind == STEPS:                       # wrapping 16-bit addition: exact for any difference
        return (bits(old).to(torch.int32) + vals.to(torch.int32)).to(torch.int16).view(dtype)
    return vals
