"""MoE routing replay: routes (each token's top-k experts per MoE layer) laid out the way a
megatron-core router sees its tokens, and handed to megatron's own replay mechanism
(`megatron/core/transformer/moe/router_replay.py`, switched on by TransformerConfig
`moe_enable_routing_replay`).

    routes = batch.batch[KEY]                                   # [B, S, L, K] uint8 / int16
    micro = micro_routes(mb_routes, lens, packed=True, cols=T)  # [1, T, L, K]: the packed row
    local = local_tokens(micro, layer, sp_rank=1, sp=2)         # [T/2 * 1, K] int64: what router `layer` sees

The batch layout (shared with the rollout, megarl/rollout/): `routed_experts` [B, S, L, K] is aligned
position by position with `input_ids` (prompt + response, right-padded), L = the model's MoE
layers in layer order, K = the router's top-k, in the smallest integer type that holds an
expert id (`route_dtype`). Padding positions hold 0 and are never used: this module lays out
padding as experts 0..K-1 (a valid, duplicate-free top-k) so routers run on it unchanged.

The last real token of a row: the engine never feeds the final sampled token, so it has no
route for it; the rollout copies the previous position's routes there. That is exact for every
log-prob, entropy and loss megarl computes: attention is causal, so the routes at position p
change only the hidden states at p, and the log-prob code reads the outputs at positions
prompt_len - 1 + j for j < response_len (megarl/workers/batching.py response_positions), never
at the last real position (tests/test_routing_replay.py checks it by perturbing those routes).

Everything here is a pure function of tensors (no megatron import); which engines record routes
is each engine's declaration (megarl/engines/, `records_routes`). megarl/workers/routes.py drives
the routers of one model (its own modules, never RouterReplay's process-wide list) and moves
routes between ranks.
"""
from __future__ import annotations

import torch

KEY = "routed_experts"
MODES = ("disabled", "R2", "R3")


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type holding an expert id: uint8 up to 256 experts, else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit int16 routes")


def bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """Bytes of routes per token: MoE layers x top-k x 1 (<= 256 experts) or 2."""
    return num_layers * topk * torch.empty((), dtype=route_dtype(num_experts)).element_size()


def micro_routes(routes: torch.Tensor, lens: torch.Tensor, packed: bool, cols: int) -> torch.Tensor:
    """Routes of one micro-batch laid out like its input ids (megarl/workers/packing.py): packed,
    the rows' real tokens back to back in one [1, cols, L, K] row; padded, [b, cols, L, K] rows cut
    or padded to `cols`. Padding gets experts 0..K-1."""
    b, S, L, K = routes.shape
    fill = torch.arange(K, device=routes.device, dtype=routes.dtype)
    if packed:
        seg = lens.clamp(min=1).tolist()
        out = fill.expand(1, cols, L, K).clone()
        at = 0
        for i, n in enumerate(seg):
            out[0, at:at + n] = routes[i, :n]
            at += n
        return out
    out = fill.expand(b, cols, L, K).clone()
    width = min(cols, S)
    real = torch.arange(width, device=routes.device).unsqueeze(0) < lens.unsqueeze(1)     # [b, width]
    out[:, :width] = torch.where(real[..., None, None], routes[:, :width], out[:, :width])
    return out


def local_tokens(micro: torch.Tensor, layer: int, sp_rank: int = 0, sp: int = 1) -> torch.Tensor:
    """[b, s, L, K] routes of the sequence this rank holds (after any context-parallel split) ->
    [s/sp * b, K] int64 for MoE layer `layer`: the token order of the router's input, which is
    [s, b, h] flattened, split over `sp` sequence-parallel ranks along s (megatron's scatter to the
    sequence-parallel region keeps contiguous chunk `sp_rank`)."""
    seq = micro[:, :, layer].transpose(0, 1)                       # [s, b, K]
    s = seq.shape[0]
    if s % sp:
        raise ValueError(f"{s} positions do not split over {sp} sequence-parallel ranks")
    part = seq[sp_rank * (s // sp):(sp_rank + 1) * (s // sp)]
    return part.reshape(-1, part.shape[-1]).long()


def place_tokens(recorded: torch.Tensor, out: torch.Tensor, layer: int, sp_rank: int = 0, sp: int = 1) -> None:
    """The inverse of local_tokens: a router's recorded [s/sp * b, K] indices written into
    `out` [b, s, L, K] at this rank's sequence-parallel chunk of layer `layer`."""
    b, s = out.shape[:2]
    chunk = s // sp
    part = recorded.reshape(chunk, b, -1).transpose(0, 1)          # [b, chunk, K]
    out[:, sp_rank * chunk:(sp_rank + 1) * chunk, layer] = part.to(out.dtype)


def unpack_rows(micro: torch.Tensor, lens: torch.Tensor, packed: bool, width: int) -> torch.Tensor:
    """The inverse of micro_routes: [b', cols, L, K] -> [b, width, L, K] rows in batch layout,
    padding 0."""
    b = lens.shape[0]
    L, K = micro.shape[2:]
    out = torch.zeros(b, width, L, K, dtype=micro.dtype, device=micro.device)
    if packed:
        at = 0
        for i, n in enumerate(lens.clamp(min=1).tolist()):
            n_in = min(n, width)
            out[i, :n_in] = micro[0, at:at + n_in]
            at += n
        return out
    w = min(width, micro.shape[1])
    real = torch.arange(w, device=micro.device).unsqueeze(0) < lens.unsqueeze(1)
    out[:, :w] = torch.where(real[..., None, None], micro[:, :w], out[:, :w])
    return out


def place_sequence(local: torch.Tensor, cp_rank: int, cp: int, dim: int) -> torch.Tensor:
    """The inverse of context_parallel.split_sequence: this CP rank's two chunks written into a
    zero full-sequence tensor (the other ranks' chunks stay 0, so a sum over the CP group fills it)."""
    if cp == 1:
        return local
    shape = list(local.shape)
    shape[dim] *= cp
    full = torch.zeros(shape, dtype=local.dtype, device=local.device)
    chunks = full.chunk(2 * cp, dim=dim)
    first, second = local.chunk(2, dim=dim)
    chunks[cp_rank].copy_(first)
    chunks[2 * cp - 1 - cp_rank].copy_(second)
    return full


def check_routes(routes: torch.Tensor, input_ids: torch.Tensor, num_layers: int, topk: int, num_experts: int) -> None:
    """One line naming what is wrong with a batch's routes (shape, type, expert ids)."""
    want = (*input_ids.shape, num_layers, topk)
    if tuple(routes.shape) != want:
        raise ValueError(f"batch['{KEY}'] has shape {tuple(routes.shape)}, expected [B, S, MoE layers, top-k] = "
                         f"{list(want)} aligned with input_ids")
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"batch['{KEY}'] must hold integer expert ids, not {routes.dtype}")
    if routes.numel() and int(routes.max()) >= num_experts:
        raise ValueError(f"batch['{KEY}'] names expert {int(routes.max())}, but the model has {num_experts}")
