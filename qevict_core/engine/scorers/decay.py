"""Appendix J's decayed score: older attention counts less."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer


@dataclass
class DecayScorer(Scorer):
    """Eq. 22: S_t = λ S_{t-Ω} + u_t. The decay is applied right after an event, so the steps that follow add to
    λ S_{t-Ω} and the next event ranks exactly Eq. 22's value."""

    name = "decay"
    decay: float = 0.99

    @classmethod
    def from_config(cls, cfg):
        return cls(pool=cfg.pool, pool_weight=cfg.pool_weight, pool_direction=cfg.pool_direction, decay=cfg.decay)

    def carry(self, table):
        table.mul_(self.decay)
