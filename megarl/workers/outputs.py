"""What the last pipeline stage makes of the model's output, per micro-batch (all [b, R]).

    log_prob_outputs(logits, mb, ...)  -> {"log_probs", "entropy"}  at the response positions
    value_outputs(values, mb)          -> {"values"}                  state before each response token
    full_logits(logits, vocab, group)  -> [b, s, V] with the TP shards gathered (verification)

Positions and masks follow megarl/workers/batching.py; entries past response_lens are 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.protocol import DataProto
from megarl.workers.batching import response_positions, valid_mask
from megarl.workers.logprob import token_log_probs


def _at_responses(out: torch.Tensor, mb: DataProto) -> torch.Tensor:
    """[b, s, d] -> [b, R, d] taken at prompt_lens - 1 + j."""
    R = mb.batch["responses"].shape[1]
    pos = response_positions(mb.batch["prompt_lens"].to(out.device), R, out.shape[1])
    return out.gather(1, pos.unsqueeze(-1).expand(-1, -1, out.shape[-1]))


def log_prob_outputs(logits: torch.Tensor, mb: DataProto, vocab_size: int, tp_rank: int, group,
                     temperature: float, with_entropy: bool = True) -> dict[str, torch.Tensor]:
    """logits [b, s, V_local]: this TP rank's vocabulary rows (padding included)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts report log-probs at 1.0)")
    picked = _at_responses(logits, mb).float() / temperature  # [b, R, V_local]
    targets = mb.batch["responses"].to(logits.device)
    lp, ent = token_log_probs(picked, targets, tp_rank * logits.shape[-1], vocab_size, group, with_entropy)
    keep = valid_mask(mb.batch["response_lens"].to(logits.device), targets.shape[1])
    out = {"log_probs": lp * keep}
    if ent is not None:
        out["entropy"] = ent * keep
    return out


def value_outputs(values: torch.Tensor, mb: DataProto) -> dict[str, torch.Tensor]:
    """values [b, s, 1] from the value head."""
    v = _at_responses(values, mb).squeeze(-1).float()
    keep = valid_mask(mb.batch["response_lens"].to(values.device), v.shape[1])
    return {"values": v * keep}


def full_logits(logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """[b, s, V_local] shards -> [b, s, V] (padding dropped) on every TP rank."""
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]
