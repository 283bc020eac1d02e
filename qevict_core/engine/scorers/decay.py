"""Appendix J's decayed score: older attention counts less."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer

# This scorer's own settings, QEvictConfig fields (qevict_core/scorer_files.py reads this literal without importing
# the module): name -> default, help, kind and the allowed values (config.Knob's low, high, open, choices).
PARAMETERS = {"decay": {"default": 0.99, "help": "λ, the share of a window's score kept at each routing event",
                        "kind": "float", "low": 0, "high": 1, "open": ("low",)}}


@dataclass
class DecayScorer(Scorer):
    """Eq. 22: S_t = λ S_{t-Ω} + u_t. The decay is applied right after an event, so the steps that follow add to
    λ S_{t-Ω} and the next event ranks exactly Eq. 22's value."""

    name = "decay"
    decay: float = PARAMETERS["decay"]["default"]

    def carry(self, table):
        table.mul_(self.decay)
