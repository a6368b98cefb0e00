"""R3's record in the built-in engine: the experts its own router chose, per token and MoE layer.

    rec = RouteRecord(slots, groups, max_tokens, prompt_len, layers, topk, dtype, device)
    buf = rec.prefill_buffer(k, P)           # model.prefill(..., routes=buf); rec.store_prefill(g0, buf)
    model.decode(..., routes=rec.step)       # then rec.store_step(B, rows.step)
    routes = rec.take(fin, grp, glen, steps) # host tensors [prompt + fed tokens, layers, topk]

Only built when rollout routing replay is on (NativeEngine(record_routes=True)); otherwise the
engine allocates and copies nothing. Where the ids come from:
- prompt positions: the prefill that wrote the prompt's K/V, stored with the prompt group, so the
  n samples that share the group (the engine's only prefix reuse) all get the same prompt routes
  (the ones their tokens were actually computed on) without a second prefill;
- generated positions: the decode step that fed the token (its K/V and every later token's
  attention to it were computed with these routes). The last sampled token is never fed, so it
  has no record: the rollout contract fills it (megarl/rollout/base.py pack_completions).
All writes are in-place indexed copies into preallocated buffers, so a decode step stays
capturable in a CUDA graph and reads nothing back to the host.
"""
from __future__ import annotations

import torch


class RouteRecord:
    def __init__(self, slots: int, groups: int, max_tokens: int, prompt_len: int, layers: int, topk: int,
                 dtype: torch.dtype, device):
        e = dict(dtype=dtype, device=device)
        self.max_tokens, self.prompt_len = max_tokens, prompt_len
        self.rows = torch.zeros(slots, max_tokens, layers, topk, **e)    # column j: response token j
        self.groups = torch.zeros(groups, prompt_len, layers, topk, **e)  # the prompt of each group
        self.step = torch.zeros(slots, layers, topk, **e)                # one decode step's ids

    @staticmethod
    def bytes_per_token(layers: int, topk: int, dtype: torch.dtype) -> int:
        return layers * topk * torch.empty((), dtype=dtype).element_size()

    def fits(self, slots: int, groups: int, max_tokens: int, prompt_len: int) -> bool:
        return (self.rows.shape[0] >= slots and self.groups.shape[0] >= groups and self.max_tokens >= max_tokens
                and self.prompt_len >= prompt_len)

    def prefill_buffer(self, prompts: int, length: int) -> torch.Tensor:
        return torch.empty(prompts, length, *self.rows.shape[2:], dtype=self.rows.dtype, device=self.rows.device)

    def store_prefill(self, g0: int, buf: torch.Tensor) -> None:
        """Prompts prefilled into groups g0.. (their padding positions are never read)."""
        self.groups[g0:g0 + buf.shape[0], :buf.shape[1]] = buf

    def store_step(self, B: int, step: torch.Tensor) -> None:
        """Rows 0..B-1 just fed their token step-1 (step: tokens generated before this decode)."""
        col = (step[:B] - 1).clamp(min=0, max=self.max_tokens - 1)        # parked rows: their own column 0
        self.rows[torch.arange(B, device=col.device), col] = self.step[:B]

    def move_groups(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, device=self.groups.device)
        self.groups[torch.tensor(dst, device=self.groups.device)] = self.groups[s]

    def take(self, rows: torch.Tensor, groups: list[int], glens: list[int], steps: list[int]) -> list[torch.Tensor]:
        """Finished rows -> per row [prompt length + steps - 1, layers, topk] on the host: one copy
        of their generated routes and one of their groups' prompt routes."""
        fed = self.rows[rows, :max(steps) - 1].cpu()
        uniq = sorted(set(groups))
        prompts = self.groups[torch.tensor(uniq, device=self.groups.device), :max(glens)].cpu()
        at = {g: i for i, g in enumerate(uniq)}
        return [torch.cat([prompts[at[g], :p], fed[i, :s - 1]])
                for i, (g, p, s) in enumerate(zip(groups, glens, steps))]
