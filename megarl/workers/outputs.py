"""What the last pipeline stage makes of the model's output, per micro-batch (all [b, R]).

    log_prob_outputs(hidden, mb, weight, ...) -> {"log_probs", "entropy"}  at the response positions
    value_outputs(values, mb)                 -> {"values"}                  state before each response token
    full_logits(hidden, weight, vocab, group) -> [b, s, V] with the TP shards gathered (verification)

The engine (megarl/workers/engine.py) sets mb.batch["out_index"] [b, R]: where, in the output
flattened over its first two dims (padded [b, s] or packed [1, T]), sits the state that predicts
responses[:, j]. Entries past response_lens are 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.workers.batching import response_positions, valid_mask
from megarl.workers.logprob import linear_log_probs


def _at_responses(out: torch.Tensor, mb: DataProto) -> torch.Tensor:
    """[b, s, d] (or packed [1, T, d]) -> [b, R, d] at the response positions."""
    if "out_index" in mb.batch:
        return out.flatten(0, 1)[mb.batch["out_index"].to(out.device)]
    R = mb.batch["responses"].shape[1]
    pos = response_positions(mb.batch["prompt_lens"].to(out.device), R, out.shape[1])
    return out.gather(1, pos.unsqueeze(-1).expand(-1, -1, out.shape[-1]))


def log_prob_outputs(hidden: torch.Tensor, mb: DataProto, weight: torch.Tensor, vocab_size: int, tp_rank: int,
                     group, temperature: float, with_entropy: bool = True,
                     entropy_grad: bool = True, weight_grad_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """hidden [b, s, h] final hidden states; weight [V_local, h]: this TP rank's LM-head rows
    (padding included). The entropy has gradients only with `entropy_grad` (an entropy bonus)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts report log-probs at 1.0)")
    picked = _at_responses(hidden, mb)                                   # [b, R, h]
    targets = mb.batch["responses"].to(hidden.device)
    lp, ent = linear_log_probs(picked.flatten(0, 1), weight, targets.flatten(), tp_rank * weight.shape[0],
                               vocab_size, group, temperature, with_entropy, entropy_grad,
                               weight_grad_scale=weight_grad_scale)
    keep = valid_mask(mb.batch["response_lens"].to(hidden.device), targets.shape[1])
    out = {"log_probs": lp.view_as(targets) * keep}
    if ent is not None:
        out["entropy"] = ent.view_as(targets) * keep
    return out


def value_outputs(values: torch.Tensor, mb: DataProto) -> dict[str, torch.Tensor]:
    """values [b, s, 1] from the value head."""
    v = _at_responses(values, mb).squeeze(-1).float()
    keep = valid_mask(mb.batch["response_lens"].to(values.device), v.shape[1])
    return {"values": v * keep}


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, group, mb: DataProto) -> torch.Tensor:
    """Hidden states -> [b, s, V] logits (padding dropped) on every TP rank, rows as padded input
    (packed outputs are laid back into rows of the batch's width)."""
    logits = (hidden @ weight.t()).float()
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    logits = logits[..., :vocab_size]
    S = mb.batch["input_ids"].shape[1]
    if logits.shape[0] == len(mb) and logits.shape[1] >= S:
        return logits[:, :S]
    # packed [1, T, V]: row i's tokens start at last_index[i] - len_i + 1
    lens = (mb.batch["prompt_lens"] + mb.batch["response_lens"]).clamp(min=1)
    starts = mb.batch["last_index"].to(logits.device) - lens.to(logits.device) + 1
    flat = logits.flatten(0, 1)
    out = flat.new_zeros(len(mb), S, flat.shape[-1])
    for i in range(len(mb)):
        out[i, :int(lens[i])] = flat[int(starts[i]):int(starts[i]) + int(lens[i])]
    return out
