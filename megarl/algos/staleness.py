"""Weight versions of sampled tokens in async training: staleness per sample, the bound on it,
and the per-step histogram.

Version v = the weights after v policy updates (v0 = the initial weights). Every response token
records the version that sampled it (`token_versions`, [B, R], -1 on padding); with partial
rollouts one response can span versions. A sample's staleness, when the trainer holds version V
(it is about to make update V + 1), is V - (oldest version among its tokens).

    stale = stale_rows(token_versions, response_mask, current_version, max_staleness)   # [B] bool
    metrics = staleness_metrics(token_versions, response_mask, current_version)
"""
from __future__ import annotations

import torch


@torch.no_grad()
def sample_versions(token_versions: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(oldest, newest) version per sample over its response tokens; a sample without response
    tokens takes the version its generation started under (column 0)."""
    m = response_mask > 0
    big = torch.iinfo(token_versions.dtype).max
    oldest = torch.where(m, token_versions, torch.full_like(token_versions, big)).min(-1).values
    newest = torch.where(m, token_versions, torch.full_like(token_versions, -1)).max(-1).values
    empty = ~m.any(-1)
    oldest = torch.where(empty, token_versions[:, 0], oldest)
    newest = torch.where(empty, token_versions[:, 0], newest)
    return oldest, newest


@torch.no_grad()
def sample_staleness(token_versions: torch.Tensor, response_mask: torch.Tensor, current_version: int) -> torch.Tensor:
    oldest, _ = sample_versions(token_versions, response_mask)
    return current_version - oldest


@torch.no_grad()
def stale_rows(token_versions: torch.Tensor, response_mask: torch.Tensor, current_version: int,
               max_staleness: int) -> torch.Tensor:
    """[B] bool: samples with a token older than `max_staleness` versions behind `current_version`."""
    return sample_staleness(token_versions, response_mask, current_version) > max_staleness


@torch.no_grad()
def staleness_metrics(token_versions: torch.Tensor, response_mask: torch.Tensor, current_version: int,
                      bins: int = 4) -> dict[str, float]:
    """The step's staleness histogram (share of samples at staleness 0, 1, ..., `bins`+ ), its
    mean and max, and the share of samples whose tokens span more than one version."""
    s = sample_staleness(token_versions, response_mask, current_version)
    oldest, newest = sample_versions(token_versions, response_mask)
    n = max(len(s), 1)
    out = {f"async/staleness_hist/{k}": float((s == k).sum()) / n for k in range(bins)}
    out[f"async/staleness_hist/{bins}+"] = float((s >= bins).sum()) / n
    out["async/staleness_mean"] = float(s.float().mean()) if len(s) else 0.0
    out["async/staleness_max"] = float(s.max()) if len(s) else 0.0
    out["async/mixed_version_fraction"] = float((newest != oldest).sum()) / n
    return out
