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
    kq = min(k_quant, c - kf)
    full, quant = decide(rank, eligible, torch.full((b, 1), kf), torch.full((b, 1), kq))
    return RoutingDecision(_by_id(_picked(full, kf), window_ids), _by_id(_picked(quant, kq), window_ids), c)


def decide(rank: torch.Tensor, eligible: torch.Tensor | None, k_full: torch.Tensor, k_quant: torch.Tensor,
           order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing decision, for a layer's batch rows or a layer's KV heads alike: rank (R, C); eligible (R, C)
    the candidates that may enter the full tier (None: all); k_full, k_quant (R, 1) per row. -> (full, quant) (R, C)
    bool: the first K_f of the eligible candidates in a stable descending sort of their ranks, then the first K_q
    of the others. ``order``: that sort, when the caller already has it (per-head allocation does)."""
    lowest = torch.finfo(rank.dtype).min
    if order is None:
        order = (rank if eligible is None else torch.where(eligible, rank, lowest)).sort(
            dim=1, descending=True, stable=True).indices
    full = _first(order, k_full)
    quant = _first(rank.masked_fill(full, lowest).sort(dim=1, descending=True, stable=True).indices, k_quant)
    return full, quant


def _first(order: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """order (R, C) a permutation per row -> (R, C) bool: the candidates in row r's first k[r] places."""
    taken = torch.arange(order.shape[1], device=order.device) < k.to(order.device)
    return torch.zeros_like(taken).scatter_(1, order, taken)


def _picked(mask: torch.Tensor, k: int) -> torch.Tensor:
    """(R, C) bool with k set per row -> (R, k) candidate indices in candidate order. A stable sort puts a row's set
    places first, in their order; unlike ``nonzero`` it needs no count from the device (no host round trip)."""
    return mask.to(torch.uint8).argsort(dim=1, descending=True, stable=True)[:, :k]


def _by_id(picked: torch.Tensor, window_ids: torch.Tensor) -> torch.Tensor:
    order = window_ids.gather(1, picked).argsort(dim=1)
    return picked.gather(1, order)
