"""Window ranking functions (Section 4.2 and Appendix J).

A scorer owns one float32 table per layer, ``(B, num_windows)``, indexed by window id. Attention-based scorers
fold in ``u_t(w)``, the attention mass a window received from the queries since the previous routing event
(Eq. 20); ``ranking`` turns the table into the key that routing sorts by (higher is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import QEvictConfig


@dataclass
class Scorer:
    needs_attention = True

    def update(self, table: torch.Tensor, mass: torch.Tensor) -> None:
        """Fold one routing event's attention mass (B, W) into the table, in place."""
        raise NotImplementedError

    def on_aged(self, table: torch.Tensor, window_ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Called with the fp keys (B, H, n*Ω, D) of windows leaving the recent region."""

    def ranking(self, table: torch.Tensor) -> torch.Tensor:
        return table


@dataclass
class CumulativeScorer(Scorer):
    """Eq. 1 / 21: S_t = S_{t-Ω} + u_t."""

    def update(self, table, mass):
        table.add_(mass)


@dataclass
class DecayScorer(Scorer):
    """Eq. 22: S_t = λ S_{t-Ω} + u_t."""

    decay: float = 0.99

    def update(self, table, mass):
        table.mul_(self.decay).add_(mass)


@dataclass
class PNormScorer(Scorer):
    """Eq. 23: S_t = (Σ_r u_r^p)^(1/p). The table keeps Σ u^p, which sorts the same way."""

    p: float = 3.0

    def update(self, table, mass):
        table.add_(mass.pow(self.p))

    def ranking(self, table):
        return table.pow(1.0 / self.p)


@dataclass
class KeyNormScorer(Scorer):
    """Eq. 24: S(w) = -mean_i ||k_i||, attention-free; set once when the window leaves the recent region."""

    needs_attention = False

    def on_aged(self, table, window_ids, keys):
        b, h = keys.shape[:2]
        norms = keys.float().norm(dim=-1).reshape(b, h, window_ids.shape[1], -1)  # (B, H, n, Ω)
        per_window = -norms.mean(dim=(1, 3))  # (B, n)
        table.scatter_(1, window_ids.long().expand(b, -1), per_window)

    def update(self, table, mass):
        raise RuntimeError("keynorm needs no attention mass")


def make_scorer(cfg: QEvictConfig) -> Scorer:
    return {
        "cumulative": lambda: CumulativeScorer(),
        "decay": lambda: DecayScorer(cfg.decay),
        "pnorm": lambda: PNormScorer(cfg.p),
        "keynorm": lambda: KeyNormScorer(),
    }[cfg.scorer]()
