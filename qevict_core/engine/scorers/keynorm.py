"""Appendix J's attention-free score: windows with small keys rank higher."""

from __future__ import annotations

from dataclasses import dataclass

from .scorer_base import Scorer


@dataclass
class KeyNormScorer(Scorer):
    """Eq. 24: S(w) = -mean_i ||k_i||, attention-free; set once when the window leaves the recent region."""

    name = "keynorm"
    needs_attention = False
    reads_aged_keys = True

    def on_aged(self, table, window_ids, keys):
        b, h = keys.shape[:2]
        norms = keys.float().norm(dim=-1).reshape(b, h, window_ids.shape[1], -1)  # (B, H, n, Ω)
        per_window = -norms.mean(dim=(1, 3))  # (B, n)
        table.scatter_(1, window_ids.long().expand(b, -1), per_window)

    def mass_table(self, table, interval):
        raise RuntimeError("keynorm needs no attention mass")
