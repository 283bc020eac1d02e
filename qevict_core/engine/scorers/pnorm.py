"""Appendix J's p-norm score: an interval's attention peaks count more than its spread."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer


@dataclass
class PNormScorer(Scorer):
    """Eq. 23: S_t = (Σ_r u_r^p)^(1/p). The table keeps Σ u^p, which sorts the same way."""

    name = "pnorm"
    p: float = 3.0
    keeps_interval = True

    @classmethod
    def from_config(cls, cfg):
        return cls(pool=cfg.pool, pool_weight=cfg.pool_weight, pool_direction=cfg.pool_direction, p=cfg.p)

    def mass_table(self, table, interval):
        return interval

    def settle(self, table, interval):
        table.add_(interval.pow(self.p))
        interval.zero_()

    def ranking(self, table):
        return table.pow(1.0 / self.p)
