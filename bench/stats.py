"""Paired comparisons over shared samples: the mean difference with a 95% bootstrap interval.

Two methods run on the same prompts (or passages) give paired scores; what a reader may call a difference is a
difference whose interval excludes zero. The bootstrap resamples the pairs (percentile interval, a fixed seed, so a
re-render gives the same numbers); with fewer than two pairs there is no interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RESAMPLES = 10_000


@dataclass(frozen=True)
class Paired:
    mean: float  # mean of a - b over the pairs
    low: float | None  # 95% bootstrap interval of that mean; None with fewer than two pairs
    high: float | None
    pairs: int

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def verdict(self, better: str = "higher") -> str:
        """'better' / 'worse' where the interval excludes zero (``better``: which sign is good), else
        'indistinguishable'."""
        if not self.excludes_zero:
            return "indistinguishable"
        good = self.mean > 0 if better == "higher" else self.mean < 0
        return "better" if good else "worse"

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        """'+12.5 [+2.5, +22.5]' (values times ``scale``)."""
        if self.low is None:
            return f"{self.mean * scale:+.{digits}f}"
        return f"{self.mean * scale:+.{digits}f} [{self.low * scale:+.{digits}f}, {self.high * scale:+.{digits}f}]"


def paired(a: list[float], b: list[float], seed: int = 0) -> Paired:
    """a[i] and b[i] measured on the same sample i."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths (got {len(a)} and {len(b)})")
    if not a:
        raise ValueError("no shared samples to compare")
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    mean = float(diff.mean())
    if len(diff) < 2:
        return Paired(mean, None, None, len(diff))
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(diff), (RESAMPLES, len(diff)), generator=g)
    means = diff[picks].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return Paired(mean, low, high, len(diff))


def shared(by_key_a: dict, by_key_b: dict) -> tuple[list[float], list[float]]:
    """Values of the keys both dicts hold, in one order: the pairs of a paired comparison."""
    keys = sorted(set(by_key_a) & set(by_key_b))
    return [by_key_a[k] for k in keys], [by_key_b[k] for k in keys]
