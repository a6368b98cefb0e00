"""Slot KV cache for continuous batching.

One tensor per K and V: [layers, slots, kv_heads, max_len, head_dim]. Active sequences always
occupy slots 0..B-1, so a decode step reads plain views (no gather) and its shapes depend on B
alone (what a CUDA graph needs). When sequences finish, the last active slots move into their
places (`move`: one indexed copy for all of them). The n samples of a prompt share one prefill,
whose K/V the model writes straight into the n slots.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.k = self.v = None                  # allocated by ensure()
        self.slots = self.max_len = 0

    def bytes_per_slot_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def ensure(self, slots: int, max_len: int) -> None:
        """Make room for `slots` sequences of `max_len` tokens (grows, never shrinks, until free())."""
        if self.k is not None and self.slots >= slots and self.max_len >= max_len:
            return
        slots, max_len = max(slots, self.slots), max(max_len, self.max_len)
        shape = (self.layers, slots, self.kv_heads, max_len, self.head_dim)
        self.k = self.v = None                  # drop the old buffers before allocating the new ones
        # Zeros, not empty: masked-out positions get attention weight 0, and 0 * NaN from
        # uninitialised memory would still poison the output.
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots, self.max_len = slots, max_len

    def free(self) -> None:
        self.k = self.v = None
        self.slots = self.max_len = 0

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy slots `src` (their first `length` positions) into slots `dst`, pairwise; disjoint."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for t in (self.k, self.v):
            t[:, d, :, :length] = t[:, s, :, :length]
