"""The bucket pipeline every transport runs: move bucket k+1 while the engine loads bucket k.

    error, wire = run_pipeline(buckets, start, load, overlap=True, abort=engine.abort_weight_update)
    # start(bucket) -> Transfer: post the collectives that fill (and send) its buffer
    # load(bucket, buf):          hand the filled buffer to the engine (megarl/checkpoint_engine/stream.py)

The transports (colocated.py, distributed.py) differ only in how a bucket moves and where it
lands; the order of steps, the overlap, and the failure rules live here, once:
  - a load that raises is kept, and the later buckets still move without loading, so no rank is
    left waiting in a collective; the caller reports the kept error on every rank (base.conclude);
  - a collective that raises leaves no way to agree: the engine drops what it staged (abort) and
    the exception propagates.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Transfer:
    """One bucket on the move: its buffer, the collectives filling it, and `then` (posted once it
    is filled: the sends that forward it while the engine loads it), waited for in finish()."""

    def __init__(self, buf: torch.Tensor | None, filling=(), then: Callable[[], list] | None = None,
                 sending=()):
        self.buf, self.filling, self.then, self.sending = buf, list(filling), then, list(sending)

    def ready(self) -> torch.Tensor | None:
        for work in self.filling:
            work.wait()
        if self.then is not None:
            self.sending.extend(self.then())
        return self.buf

    def finish(self) -> None:
        for work in self.sending:
            work.wait()
        self.buf = None


def run_pipeline(buckets: Sequence, start: Callable[[object], Transfer],
                 load: Callable[[object, torch.Tensor | None], None], *, overlap: bool,
                 abort: Callable[[], None]) -> tuple[BaseException | None, int]:
    """Every bucket started, filled and loaded in order. Returns (the first load error or None,
    bytes received). With `overlap`, bucket k+1 is posted before bucket k loads, so at most two
    buckets are in flight; without it, bucket k+1 is posted once bucket k is done."""
    error: BaseException | None = None
    wire = 0
    try:
        nxt = start(buckets[0]) if buckets else None
        for k, bucket in enumerate(buckets):
            cur, nxt = nxt, None
            buf = cur.ready()
            wire += 0 if buf is None else buf.numel() * buf.element_size()
            if overlap and k + 1 < len(buckets):
                nxt = start(buckets[k + 1])
            if error is None:      # after a failure, keep moving buckets so no rank hangs
                try:
                    load(bucket, buf)
                except Exception as err:  # noqa: BLE001 - reported on every rank by base.conclude()
                    error = err
            cur.finish()
            del buf, cur
            if nxt is None and k + 1 < len(buckets):
                nxt = start(buckets[k + 1])
    except BaseException:          # a collective failed: no agreement is possible, stop here
        abort()
        raise
    return error, wire
