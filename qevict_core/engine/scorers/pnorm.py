"""Appendix J's p-norm score: an interval's attention peaks count more than its spread."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer

# This scorer's own settings, QEvictConfig fields (qevict_core/scorer_files.py reads this literal without importing
# the module): name -> default, help, kind and the allowed values (config.Knob's low, high, open, choices).
PARAMETERS = {"p": {"default": 3.0, "help": "the exponent p: how much more an interval's peaks count than its "
                    "spread", "kind": "float", "low": 1}}


@dataclass
class PNormScorer(Scorer):
    """Eq. 23: S_t = (Σ_r u_r^p)^(1/p). The table keeps Σ u^p, which sorts the same way."""

    name = "pnorm"
    p: float = PARAMETERS["p"]["default"]
    keeps_interval = True

    def mass_table(self, table, interval):
        return interval

    def settle(self, table, interval):
        table.add_(interval.pow(self.p))
        interval.zero_()

    def ranking(self, table):
        return table.pow(1.0 / self.p)
