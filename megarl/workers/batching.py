"""Pure batch helpers for the workers: checks, data-parallel slices, micro-batches, positions.

Batch keys (megarl/protocol.py): input_ids [B, S] right-padded prompt+response, prompt_lens [B],
response_lens [B], responses [B, R], response_mask [B, R]. The token predicted at position
p = prompt_lens - 1 + j is responses[:, j]; the value head's state for that token sits at p too.
"""
from __future__ import annotations

import torch

from megarl.protocol import DataProto

REQUIRED = ("input_ids", "prompt_lens", "response_lens", "responses")


def check_batch(data: DataProto, need_mask: bool = False) -> None:
    """Refuse a batch whose fields disagree, naming the key and the row."""
    keys = REQUIRED + (("response_mask",) if need_mask else ())
    for key in keys:
        if key not in data.batch:
            raise ValueError(f"batch has no {key!r}; the rollout stage writes {', '.join(keys)} (megarl/protocol.py)")
    ids, plen, rlen, resp = (data.batch[k] for k in REQUIRED)
    B, S = ids.shape
    R = resp.shape[1]
    if (plen < 1).any():
        raise ValueError(f"prompt_lens must be >= 1 (row {int((plen < 1).nonzero()[0])})")
    if ((rlen < 0) | (rlen > R)).any():
        raise ValueError(f"response_lens must be within [0, {R}] (row {int(((rlen < 0) | (rlen > R)).nonzero()[0])})")
    if ((plen + rlen) > S).any():
        row = int(((plen + rlen) > S).nonzero()[0])
        raise ValueError(f"row {row}: prompt_lens + response_lens = {int(plen[row] + rlen[row])} exceeds "
                         f"input_ids width {S}")
    if need_mask and data.batch["response_mask"].shape != resp.shape:
        raise ValueError(f"response_mask has shape {tuple(data.batch['response_mask'].shape)}, "
                         f"responses {tuple(resp.shape)}")
    pos = (plen.unsqueeze(1) + torch.arange(R, device=ids.device)).clamp(max=S - 1)
    inside = torch.arange(R, device=ids.device).unsqueeze(0) < rlen.unsqueeze(1)
    wrong = (ids.gather(1, pos) != resp) & inside
    if wrong.any():
        row = int(wrong.any(1).nonzero()[0])
        raise ValueError(f"row {row}: responses differ from input_ids after the prompt; input_ids must be "
                         "prompt + response, right-padded")


def seq_len(data: DataProto) -> int:
    """Columns actually used by the batch (the rest is padding every row shares)."""
    return int((data.batch["prompt_lens"] + data.batch["response_lens"]).max().clamp(min=1))


def response_positions(prompt_lens: torch.Tensor, R: int, S: int) -> torch.Tensor:
    """[B, R] positions whose outputs predict responses[:, j] (clamped into [0, S) for padding)."""
    j = torch.arange(R, device=prompt_lens.device)
    return (prompt_lens.unsqueeze(1) - 1 + j).clamp(0, S - 1)


def valid_mask(response_lens: torch.Tensor, R: int) -> torch.Tensor:
    """[B, R] bool: j < response_lens."""
    return torch.arange(R, device=response_lens.device).unsqueeze(0) < response_lens.unsqueeze(1)


def pad_rows(data: DataProto, multiple: int) -> tuple[DataProto, int]:
    """Repeat the last row until len is a multiple of `multiple` (forward-only work: the extra
    rows' outputs are dropped). Returns (batch, real row count)."""
    n = len(data)
    extra = (-n) % multiple
    if not extra:
        return data, n
    rows = list(range(n)) + [n - 1] * extra
    return data[rows], n


def dp_slice(data: DataProto, dp_rank: int, dp: int) -> DataProto:
    """This data-parallel rank's contiguous share (rows must divide evenly)."""
    if len(data) % dp:
        raise ValueError(f"{len(data)} sequences cannot be split over {dp} data-parallel ranks; "
                         f"make the batch a multiple of {dp}")
    size = len(data) // dp
    return data[dp_rank * size:(dp_rank + 1) * size]


def check_device(data: DataProto, device: torch.device) -> None:
    """Refuse a micro-batch with a tensor off the model's device: the worker moves each step's
    share once, before micro-batching, so a stray tensor here is a bug that would otherwise
    surface as a cross-device error deep inside a loss function (or a silent host copy)."""
    for key, value in data.batch.items():
        if value.device != device:
            raise RuntimeError(f"micro-batch tensor {key!r} is on {value.device} but the model is on {device}; "
                               "the worker must move the batch with DataProto.to(device) before micro-batching")


def micro_batches(data: DataProto, size: int) -> list[DataProto]:
    return data.split(size)
