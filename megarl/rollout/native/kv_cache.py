"""KV cache for continuous batching, with the prompt's K/V shared by its n samples.

Two parts, one tensor per K and V in each:

    prompt part  [layers, groups, kv_heads, prompt_len, head_dim]   one group per prompt
    sample part  [layers, rows,   kv_heads, gen_len,    head_dim]   the tokens a sample generated

A prompt is prefilled once and its K/V written once, into its group; each of its n samples
(rows) holds only what it generates. So a prompt of P tokens with n samples of up to T tokens
takes P + n*T positions, not n*(P + T): with GRPO's long prompts and n=8 that is up to 8x less
KV memory for the prompt, and as many more rows in the same budget. Decode attends to both parts
(megarl/rollout/native/model.py: the group's prompt K/V once for all its samples' queries,
Hydragen-style, then each row's own tokens; the two softmaxes merged by log-sum-exp).

Active rows occupy 0..B-1 and active groups 0..G-1, so a decode step reads plain views (no
gather) and its shapes depend on (B, G) alone (what a CUDA graph needs). When rows or groups
finish, the last active ones move into their places (`move_rows`, `move_groups`: one indexed
copy for all of them).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        # allocated by ensure()
        self.pk: torch.Tensor | None = None
        self.pv: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.rows = self.groups = self.prompt_len = self.gen_len = 0

    def bytes_per_token(self) -> int:
        """K and V of one position, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.rows, self.groups, self.prompt_len, self.gen_len

    def nbytes(self) -> int:
        return self.bytes_per_token() * (self.groups * self.prompt_len + self.rows * self.gen_len)

    def ensure(self, rows: int, groups: int, prompt_len: int, gen_len: int) -> None:
        """Room for `rows` samples of `gen_len` tokens and `groups` prompts of `prompt_len`: the
        current buffers if they hold that much, else new ones of exactly that shape (the caller
        sizes it; megarl/rollout/native/engine.py keeps it within the memory budget)."""
        want = (rows, groups, prompt_len, gen_len)
        if self.allocated and all(w <= h for w, h in zip(want, self.shape)):
            return
        self.free()                             # drop the old buffers before allocating the new ones
        R, G, P, T = want
        # Zeros, not empty: masked-out positions get attention weight 0, and 0 * NaN from
        # uninitialised memory would still poison the output.
        part = dict(dtype=self.dtype, device=self.device)
        self.pk = torch.zeros(self.layers, G, self.kv_heads, P, self.head_dim, **part)
        self.pv = torch.zeros(self.layers, G, self.kv_heads, P, self.head_dim, **part)
        self.k = torch.zeros(self.layers, R, self.kv_heads, T, self.head_dim, **part)
        self.v = torch.zeros(self.layers, R, self.kv_heads, T, self.head_dim, **part)
        self.rows, self.groups, self.prompt_len, self.gen_len = want

    def free(self) -> None:
        self.pk = self.pv = self.k = self.v = None
        self.rows = self.groups = self.prompt_len = self.gen_len = 0

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        if self.pk is None or self.pv is None or self.k is None or self.v is None:
            raise RuntimeError("the KV cache is not allocated: ensure() comes first")
        return self.pk, self.pv, self.k, self.v

    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Rows `src` (their first `length` generated positions) into rows `dst`, pairwise; disjoint."""
        _move((self.k, self.v), src, dst, length, self.device)

    def move_groups(self, src: list[int], dst: list[int], length: int) -> None:
        """Prompt groups `src` (their first `length` positions) into groups `dst`, pairwise; disjoint."""
        _move((self.pk, self.pv), src, dst, length, self.device)


def _move(parts, src: list[int], dst: list[int], length: int, device) -> None:
    if not src:
        return
    s = torch.tensor(src, device=device)
    d = torch.tensor(dst, device=device)
    for t in parts:
        t[:, d, :, :length] = t[:, s, :, :length]
