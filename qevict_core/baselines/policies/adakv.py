from dataclasses import dataclass

import torch

from .base import global_allocation
from .snapkv import SnapKV


@dataclass
class AdaKV(SnapKV):
    """SnapKV scores with head-adaptive budgets: one top-k over all heads of a layer decides how many tokens each
    head keeps, floored at a fraction α of the uniform share. Heads keep different numbers of tokens and the
    cache frees them per head (the official code does the same with a flattened varlen cache)."""

    label = "AdaKV"
    description = "SnapKV scores with per-head budgets from one top-k across the layer's heads (α = 0.2)."
    reference = "Feng et al. 2024; FFY0/AdaKV adaptive_snapkv snapkv_utils.py (max-pool 7, α 0.2)"
    ragged = True

    kernel: int = 7
    pooling: str = "max"
    alpha: float = 0.2

    def allocate(self, scores: torch.Tensor, keep: int) -> list[int]:
        heads, n = scores.shape[1], scores.shape[2]
        adaptive = global_allocation(scores, heads * keep)
        floor = int(self.alpha * keep)
        counts = [min(n, round(c * (1 - self.alpha) + floor)) for c in adaptive]
        while sum(counts) > heads * keep:  # rounding must never exceed the layer's share
            counts[counts.index(max(counts))] -= 1
        return counts
