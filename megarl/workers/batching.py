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


# -- micro-batch plans: which rows go to which DP rank and micro-batch --------------------------------
def row_tokens(data: DataProto) -> list[int]:
    """Tokens each row really holds (prompt + response; at least 1)."""
    return (data.batch["prompt_lens"] + data.batch["response_lens"]).clamp(min=1).tolist()


def plan(lengths: list[int], dp: int, micro: int, max_tokens: int | None = None,
         packed: bool = False) -> list[list[list[int]]]:
    """Row indices per [DP rank][micro-batch]. Every rank computes the same plan from the same
    batch, so the micro-batch count agrees across DP ranks and pipeline stages without a collective
    (megatron's pipeline schedule needs the same count on every stage; equal counts on every DP
    rank keep the ranks in step at the gradient reduction).

    Static (max_tokens None): contiguous equal DP slices of `micro` rows each (the row order of
    dp_slice). Dynamic: equal row counts per DP rank balanced by tokens, then micro-batches that
    each fit `max_tokens` computed tokens (the sum of lengths when packed, rows x the longest row
    when padded); ranks with fewer micro-batches split their largest ones until all match."""
    n = len(lengths)
    if n % dp:
        raise ValueError(f"{n} sequences cannot be split over {dp} data-parallel ranks; "
                         f"make the batch a multiple of {dp}")
    per = n // dp
    if max_tokens is None:
        if per % micro:
            raise ValueError(f"{per} sequences per data-parallel rank do not split into micro-batches of {micro}")
        return [[list(range(r * per + m, r * per + m + micro)) for m in range(0, per, micro)] for r in range(dp)]
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds the micro-batch token budget {max_tokens}; "
                         f"raise the *max_token_len_per_gpu key to at least {longest}")
    ranks = _balanced_equal(lengths, dp)
    bins = [_fit_budget(rows, lengths, max_tokens, packed) for rows in ranks]
    count = max(len(b) for b in bins)
    return [_split_to(b, count, lengths) for b in bins]


def micro_cost(rows: list[int], lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch computes with no padding across micro-batches."""
    lens = [lengths[i] for i in rows]
    return sum(lens) if packed else len(lens) * max(lens)


def _balanced_equal(lengths: list[int], k: int) -> list[list[int]]:
    """k groups of equal size, longest rows first to the lightest group with room (LPT)."""
    cap = len(lengths) // k
    groups: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min((j for j in range(k) if len(groups[j]) < cap), key=lambda j: (load[j], j))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


def _fit_budget(rows: list[int], lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """Fewest micro-batches found greedily that each fit `budget`. Packed: longest-first into the
    lightest of k bins, k growing until every bin fits (balanced loads keep the pipeline's common
    length close to each bin's). Padded: rows sorted by length and cut in runs, so rows of one
    micro-batch have similar lengths."""
    order = sorted(rows, key=lambda i: (-lengths[i], i))
    if not packed:
        out, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
                out.append(cur)
                cur = []
            cur.append(i)
        return [sorted(b) for b in out + [cur]]
    k = max(1, -(-sum(lengths[i] for i in rows) // budget))
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for i in order:
            j = min(range(k), key=lambda j: (load[j], j))
            bins[j].append(i)
            load[j] += lengths[i]
        if max(load) <= budget:
            return [sorted(b) for b in bins if b]
        k += 1


def _split_to(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the micro-batch with the most rows in two (alternating by length) until there are
    `count`; splitting only lowers each part's cost, so every part still fits the budget."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        j = max(range(len(bins)), key=lambda j: (len(bins[j]), j))
        if len(bins[j]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {sum(map(len, bins))} rows")
        rows = sorted(bins.pop(j), key=lambda i: (-lengths[i], i))
        bins[j:j] = [sorted(rows[0::2]), sorted(rows[1::2])]
    return bins
