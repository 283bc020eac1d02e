"""The paper's scorer and the default: cumulative attention mass."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer


@dataclass
class CumulativeScorer(Scorer):
    """Eq. 1 / 21: S_t = S_{t-Ω} + u_t."""

    name = "cumulative"
