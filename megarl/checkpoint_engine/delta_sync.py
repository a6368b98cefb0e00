"""Delta mode of the distributed transport: each sync sends only the elements that changed.

    sender = DisaggregatedSender(source, groups, bucket_bytes, dtype=torch.bfloat16, delta=DeltaOptions())
    receiver = DisaggregatedReceiver(engine, spec, groups, torch.bfloat16, bucket_bytes, delta=DeltaOptions())
    sender.sync() / receiver.sync()      # as before; metrics gain weight_sync/{anchor,changed_frac,delta_copy_mb}

Every sync starts with one small exchange over the bridge spanning both sides (`negotiate`):
trainer ranks say why they want a full sync (first sync, every `anchor_every`, after a failure,
after a resume), engine ranks report their generation id (random, drawn when the receiver is
built, so a restarted or newly joined engine has a new one) and the version they last applied
(-1 when their engine lost its weights). A full sync (*anchor*, the transport's normal path in
the engine's dtype) runs when any rank asks for one or any engine's (generation, version)
differs from what the trainers last sent to; every rank reaches the same decision.

Otherwise, per bucket, trainer TP rank t diffs its pieces (delta.piece_vector, engine dtype)
against the copy it sent last (kept in host memory: the sender's cost, `delta_copy_bytes`) and
broadcasts a header (encoding, sizes, one checksum per distinct engine layout) and the frame.
Engine ranks write the changes into the engine's live weights (RolloutEngine.weight_view) and
checksum the bucket's region of them; a mismatch fails the sync on every rank (base.conclude) and
the next sync is an anchor. With `keep_previous` an engine rank keeps the old values of what it
wrote (an undo log, the size of the delta) and restores them when the sync fails.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import torch

from megarl.checkpoint_engine import delta as D
from megarl.checkpoint_engine.pipeline import Transfer
from megarl.checkpoint_engine.plan import Bucket, TransferPlan
from megarl.rollout.base import RolloutEngine, ShardSlice
from megarl.rollout.config import codec_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeltaOptions:
    anchor_every: int = 20         # a full sync every this many syncs
    dense_above: float = 0.25      # a bucket with more than this fraction changed goes dense
    codec: str = "none"            # none, zstd, lz4: compress frames where that makes them smaller
    copy_device: str = "cpu"       # where the sender keeps its last-sent copy ("cpu": host memory)

    def __post_init__(self):
        problem = codec_problem(self.codec)
        if problem:
            raise ValueError(problem)


def delta_options(ce, engine_dtype: torch.dtype, transport: str) -> DeltaOptions | None:
    """checkpoint_engine.delta resolved for `transport` and the engine's dtype (None: full syncs).
    `on` with the colocated transport is refused by the config (rollout/config_checks.py)."""
    if ce.delta == "off":
        return None
    if transport == "colocated":
        log.info("checkpoint_engine.delta=auto resolves to off: the colocated transport moves shards between the "
                 "ranks of one job, not over a link")
        return None
    if ce.delta == "auto" and engine_dtype.itemsize > 2:
        log.info(f"checkpoint_engine.delta=auto resolves to off: the engine's weights are {engine_dtype} (delta "
                 "pays where most elements keep their 16-bit pattern from one step to the next)")
        return None
    return DeltaOptions(ce.delta_anchor_every, ce.delta_dense_above, ce.delta_compression,
                        "cpu" if ce.delta_copy == "host" else "cuda")


def engine_layout(engine: RolloutEngine, plan: TransferPlan) -> dict[str, tuple | None]:
    """HF name -> the part (dim, start, stop) this engine rank holds, or None when it ignores it."""
    shard = getattr(engine, "weight_shard", lambda n: None)
    out = {}
    for name in plan.hf_names():
        if engine.weight_view(name) is None:
            out[name] = None
            continue
        s = shard(name) or ShardSlice()
        out[name] = (s.dim, s.start, s.stop)
    return out


def layouts_of(gathered: list[dict]) -> list[dict[str, ShardSlice | None]]:
    """The distinct engine layouts among every rank's report (ranks of one rollout TP rank share one)."""
    seen = sorted({repr(sorted(g["layout"].items())): g["layout"] for g in gathered if g.get("layout")}.items())
    return [{n: (None if v is None else ShardSlice(*v)) for n, v in lay.items()} for _, lay in seen]


def layout_index(mine: dict, gathered: list[dict]) -> int:
    keys = sorted({repr(sorted(g["layout"].items())) for g in gathered if g.get("layout")})
    return keys.index(repr(sorted(mine.items())))


def decide(reports: list[dict]) -> tuple[bool, str, int]:
    """(full sync?, why, the version this sync delivers), identically on every rank."""
    trainers = [r for r in reports if r["side"] == "trainer"]
    engines = [r for r in reports if r["side"] == "engine"]
    first = trainers[0]
    reasons = sorted({r["reason"] for r in trainers if r["reason"]})
    gens = sorted(r["gen"] for r in engines)
    if gens != first["engines"]:
        reasons.append("an engine restarted or joined (its generation id is new)")
    elif any(r["applied"] != first["version"] for r in engines):
        reasons.append("an engine does not hold the last sync's weights")
    return bool(reasons), "; ".join(reasons), first["version"] + 1


def part_sums(pieces: list[D.Piece], vector: torch.Tensor, full: dict, layouts: list[dict]) -> list[int]:
    """Per engine layout, the checksum of the pieces' region that layout holds (signed int64 pairs)."""
    out = []
    for lay in layouts:
        acc = (0, 0)
        for p in pieces:
            want = lay.get(p.part.hf_name)
            shape = full[p.part.hf_name]
            ranges = None if want is None else D._ranges(p, shape, want)
            if ranges is not None:
                src = vector[p.offset:p.offset + p.numel].view(p.shape)
                acc = D.combine(acc, D.checksum(D.region(src, D.piece_origin(p, shape), ranges)))
        out += [D.as_signed(acc[0]), D.as_signed(acc[1])]
    return out


class SenderDelta:
    """The trainer side's state: last-sent copies and the reason the next sync must be full."""

    def __init__(self, plan: TransferPlan, tp_rank: int, dtype: torch.dtype, opts: DeltaOptions,
                 layouts: list[dict]):
        self.plan, self.t, self.dtype, self.opts, self.layouts = plan, tp_rank, dtype, opts, layouts
        self.full = plan.hf_shapes()
        self.last: dict[int, torch.Tensor] = {}
        self.reason: str | None = "first sync"
        self.version, self.engines, self.since_anchor = 0, [], 0
        self.changed = self.total = 0
        self.kinds = {name: 0 for name in D.KINDS.values()}     # frames sent per encoding, over the run

    def planned_bytes(self, buckets) -> int:
        """What the last-sent copy holds once every bucket of `buckets` went out."""
        return sum(p.numel for b in buckets for p in D.bucket_pieces(self.plan, b, self.t)) * self.dtype.itemsize

    def copy_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.last.values())

    def report(self) -> dict:
        reason = self.reason
        if reason is None and self.since_anchor + 1 >= self.opts.anchor_every:
            reason = f"every {self.opts.anchor_every} syncs"
        return {"side": "trainer", "reason": reason, "version": self.version, "engines": self.engines}

    def request_anchor(self, why: str) -> None:
        self.reason = self.reason or why

    def keep(self, bucket: Bucket, params) -> None:
        """Anchor: remember what a full sync delivers (the pieces in the engine's dtype)."""
        self.last[bucket.index] = self._stored(D.piece_vector(self.plan, bucket, self.t, params, self.dtype))

    def _stored(self, v: torch.Tensor) -> torch.Tensor:
        return v if v.device.type == self.opts.copy_device else v.to(self.opts.copy_device)

    def frame(self, bucket: Bucket, params) -> tuple[torch.Tensor, torch.Tensor]:
        """(header int64, payload uint8) for this rank's pieces of `bucket` (from shards `params`)."""
        new = D.piece_vector(self.plan, bucket, self.t, params, self.dtype)
        last = self.last.get(bucket.index)
        f = D.encode(new, None if last is None else last.to(new.device), self.opts.dense_above, self.opts.codec)
        pieces = D.bucket_pieces(self.plan, bucket, self.t)
        sums = part_sums(pieces, new, self.full, self.layouts)
        self.last[bucket.index] = self._stored(new)     # a failed sync forces an anchor, which rewrites it
        self.kinds[D.KINDS[f.kind]] += 1
        self.changed += f.nnz
        self.total += new.numel()
        head = torch.tensor([f.kind, D.CODECS[f.codec], f.payload.numel(), f.nnz, *sums], dtype=torch.int64)
        return head, f.payload

    def concluded(self, ok: bool, anchor: bool, version: int, engines: list) -> None:
        if not ok:
            self.reason = "the previous sync failed"
            return
        self.version, self.engines, self.reason = version, engines, None
        self.since_anchor = 0 if anchor else self.since_anchor + 1


class Incoming(Transfer):
    """One bucket's frames from the T trainer ranks: headers first, then payloads of those sizes."""

    def __init__(self, groups, bucket: Bucket, heads: int, device):
        self.g, self.bucket, self.device = groups, bucket, device
        self.heads = [torch.empty(heads, dtype=torch.int64, device=device) for _ in range(groups.tp)]
        super().__init__(None, [self._post(t, h) for t, h in enumerate(self.heads)])

    def _post(self, t: int, tensor: torch.Tensor):
        key = (t, self.bucket.stage)
        return self.g.groups[key].broadcast(tensor, src=self.g.senders[key], async_op=True)

    def ready(self) -> torch.Tensor:
        for work in self.filling:
            work.wait()
        sizes = [int(h[2]) for h in self.heads]
        self.buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        works, off = [], 0
        for t, n in enumerate(sizes):
            if n:
                works.append(self._post(t, self.buf[off:off + n]))
            off += n
        for work in works:
            work.wait()
        return self.buf


class ReceiverDelta:
    """The engine side: the generation id, applying frames in place, checking, undoing."""

    def __init__(self, engine: RolloutEngine, plan: TransferPlan, tp: int, dtype: torch.dtype):
        self.engine, self.plan, self.tp, self.dtype = engine, plan, tp, dtype
        if engine.weight_view(plan.hf_names()[0]) is None:
            raise ValueError(f"delta weight sync: the {type(engine).__name__} engine exposes no weight_view() to write "
                             "changes into; set actor_rollout_ref.rollout.checkpoint_engine.delta=off")
        self.gen = secrets.randbits(62)
        self.applied = -1
        self.layout = engine_layout(engine, plan)
        self.full = plan.hf_shapes()
        self.pieces = {(b.index, t): D.bucket_pieces(plan, b, t) for b in plan.buckets for t in range(tp)}
        self.index = 0                 # this rank's layout among the distinct ones (set once gathered)
        self.undo: list | None = None

    def report(self) -> dict:
        state = getattr(getattr(self.engine, "weights", None), "state", "ready")   # WeightState engines
        return {"side": "engine", "gen": self.gen, "applied": self.applied if state == "ready" else -1}

    def begin(self, keep_previous: bool) -> None:
        self.undo = [] if keep_previous else None
        self.engine.begin_weight_delta()

    def load(self, bucket: Bucket, buf: torch.Tensor, heads: list[torch.Tensor]) -> None:
        off = 0
        for t, head in enumerate(heads):
            kind, codec, size, nnz = (int(x) for x in head[:4])
            codec_name = next(k for k, v in D.CODECS.items() if v == codec)
            pieces = self.pieces[(bucket.index, t)]
            n = sum(p.numel for p in pieces)
            idx, vals = D.decode(kind, codec_name, buf[off:off + size], n, nnz, self.dtype)
            off += size
            self._apply(pieces, idx, vals, kind)
            got = self._sums(pieces)
            want = [int(x) for x in head[4 + 2 * self.index: 6 + 2 * self.index]]
            if got != want:
                raise ValueError(f"delta weight sync: checksum mismatch in bucket {bucket.index} from trainer TP rank "
                                 f"{t} (engine holds {got}, trainer sent {want}); the next sync sends every weight")

    def _apply(self, pieces: list[D.Piece], idx, vals, kind: int) -> None:
        if idx is None:                                  # dense: copy each piece's region
            for p in pieces:
                view, ranges, shape = self._target(p)
                if view is None:
                    continue
                dst = D.region(view, D.part_origin(self._want(p), shape), ranges)
                if self.undo is not None:
                    self.undo.append((dst, None, dst.clone()))
                dst.copy_(D.region(vals[p.offset:p.offset + p.numel].view(p.shape), D.piece_origin(p, shape), ranges))
            return
        bounds = torch.searchsorted(idx, torch.tensor([p.offset for p in pieces] + [2**62])).tolist()
        for k, p in enumerate(pieces):
            a, b = bounds[k], bounds[k + 1]
            if a == b:
                continue
            view, ranges, shape = self._target(p)
            if view is None:
                continue
            keep, flat = D.to_part(p, idx[a:b] - p.offset, shape, self._want(p))
            dst = view.view(-1)
            v = vals[a:b] if bool(keep.all()) else vals[a:b][keep]
            old = dst[flat] if kind in (D.XOR, D.STEPS) or self.undo is not None else None
            v = D.updated(kind, old, v, self.dtype)
            if self.undo is not None:
                self.undo.append((dst, flat, old))
            dst[flat] = v

    def _want(self, p: D.Piece) -> ShardSlice:
        v = self.layout[p.part.hf_name]
        return ShardSlice(*v)

    def _target(self, p: D.Piece):
        """(the engine's view of p's tensor, the region both cover, the full shape) or (None, ...)."""
        if self.layout.get(p.part.hf_name) is None:
            return None, None, None
        shape = self.full[p.part.hf_name]
        ranges = D._ranges(p, shape, self._want(p))
        if ranges is None:
            return None, None, None
        view = self.engine.weight_view(p.part.hf_name)
        if view is None or not view.is_contiguous():
            raise RuntimeError(f"engine gave no contiguous view of {p.part.hf_name} for a delta sync")
        return view, ranges, shape

    def _sums(self, pieces: list[D.Piece]) -> list[int]:
        acc = (0, 0)
        for p in pieces:
            view, ranges, shape = self._target(p)
            if view is not None:
                acc = D.combine(acc, D.checksum(D.region(view, D.part_origin(self._want(p), shape), ranges)))
        return [D.as_signed(acc[0]), D.as_signed(acc[1])]

    def restore(self) -> bool:
        """Undo this sync's writes (newest first); True when there was a log to undo."""
        if self.undo is None:
            return False
        for dst, flat, old in reversed(self.undo):
            if flat is None:
                dst.copy_(old)
            else:
                dst[flat] = old
        self.undo = None
        weights = getattr(self.engine, "weights", None)      # WeightState engines (native, hf)
        if weights is None:
            return False
        weights.undo_delta()
        return True
