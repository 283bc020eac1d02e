"""Algorithm 1, lines 1-4: rank the candidates of one layer and split them into full, quantized and evicted.

Decisions are per batch row (each sequence has its own scores); every row has the same candidate count, so the
tiers of all rows have the same sizes and stay dense tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingDecision:
    """Candidate indices (B, k) chosen for each tier, each row sorted by window id; the rest are evicted."""

    full: torch.Tensor
    quant: torch.Tensor
    num_candidates: int


def route_windows(rank: torch.Tensor, window_ids: torch.Tensor, num_quantized: int, k_full: int, k_quant: int,
                  promotion: bool) -> RoutingDecision:
    """rank, window_ids (B, C); the first ``num_quantized`` candidates are the current quantized tier.

    Full = top-K_f of the eligible candidates (quantized ones only when promotion is allowed), quantized =
    top-K_q of what remains. Ties break towards the earlier candidate, deterministically.
    """
    b, c = rank.shape
    eligible = torch.ones_like(rank, dtype=torch.bool)
    if not promotion:
        eligible[:, :num_quantized] = False
    kf = min(k_full, c if promotion else c - num_quantized)
    full = _top(rank, eligible, kf)
    remaining = torch.ones_like(eligible).scatter(1, full, False)
    quant = _top(rank, remaining, min(k_quant, c - kf))
    return RoutingDecision(_by_id(full, window_ids), _by_id(quant, window_ids), c)


def _top(rank: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    masked = torch.where(allowed, rank, torch.finfo(rank.dtype).min)
    return masked.sort(dim=1, descending=True, stable=True).indices[:, :k]


def _by_id(picked: torch.Tensor, window_ids: torch.Tensor) -> torch.Tensor:
    order = window_ids.gather(1, picked).argsort(dim=1)
    return picked.gather(1, order)
