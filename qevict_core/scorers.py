"""Window ranking functions (Section 4.2 and Appendix J).

A scorer owns one float32 table per layer, ``(B, num_windows)``, indexed by window id. Attention-based scorers
see ``u_t(w)``, the attention mass a window received from the queries since the previous routing event (Eq. 20),
one step at a time: ``fold`` adds a step's mass as it runs, ``settle`` finishes the table before a routing event
ranks it and ``carry`` prepares it for the next interval. Only a scorer that transforms a whole interval's mass
(``keeps_interval``, Eq. 23's power) needs that mass apart from the table until the event: a second (B, W) table,
charged to the budget like the first. ``ranking`` turns the table into the key that routing sorts by, and ``rank``
pools that key over neighbouring windows at every event when the config asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import QEvictConfig


# A neighbour ranks just below the window it borrows from, so the window itself still comes first.
POOL_TIE = 1e-3


@dataclass
class Scorer:
    needs_attention = True
    keeps_interval = False
    reads_aged_keys = False  # on_aged does something: it needs the keys of windows leaving the recent region
    pool: int = 0
    pool_weight: float = 1.0
    pool_direction: str = "both"

    def fold(self, table: torch.Tensor, interval: torch.Tensor | None, ids: torch.Tensor, mass: torch.Tensor) -> None:
        """Add one step's attention mass ``mass`` (B, n) of windows ``ids`` (B, n), distinct per row, in place:
        S_t = S_{t-Ω} + u_t, built up step by step."""
        self.mass_table(table, interval).scatter_add_(1, ids, mass)

    def mass_table(self, table: torch.Tensor, interval: torch.Tensor | None) -> torch.Tensor:
        """The table a step's attention mass is added to (for a kernel that folds it itself)."""
        return table

    def settle(self, table: torch.Tensor, interval: torch.Tensor | None) -> None:
        """Before a routing event ranks the table."""

    def carry(self, table: torch.Tensor) -> None:
        """After a routing event: what the table becomes before the next interval's mass is folded in."""

    def on_aged(self, table: torch.Tensor, window_ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Called with the fp keys (B, H, n*Ω, D) of windows leaving the recent region."""

    def ranking(self, table: torch.Tensor) -> torch.Tensor:
        return table

    def rank(self, table: torch.Tensor) -> torch.Tensor:
        """The key routing sorts by, (..., W): ``ranking``, pooled when the config asks for it."""
        key = self.ranking(table)
        return self._pooled(key) if self.pool else key

    def _pooled(self, key: torch.Tensor) -> torch.Tensor:
        """``key`` pooled over ``pool`` windows on either side, a neighbour's key weighted by ``pool_weight`` (γ):
        max(key(w), γ·(1 - POOL_TIE)·max over v of key(v)), v within r windows of w on either side, or (direction
        "forward") among the r windows before it."""
        width = 2 * self.pool + 1
        flat = key.reshape(-1, 1, key.shape[-1])  # (rows, 1, W): max_pool1d pools the last axis
        if self.pool_direction == "forward":  # w borrows from w - r .. w: a window lends to the text continuing it
            flat = torch.nn.functional.pad(flat, (self.pool, 0), value=float("-inf"))
            near = torch.nn.functional.max_pool1d(flat, self.pool + 1, stride=1).reshape(key.shape)
        else:
            near = torch.nn.functional.max_pool1d(flat, width, stride=1, padding=self.pool).reshape(key.shape)
        return torch.maximum(key, near * (self.pool_weight * (1 - POOL_TIE)))


@dataclass
class CumulativeScorer(Scorer):
    """Eq. 1 / 21: S_t = S_{t-Ω} + u_t."""


@dataclass
class DecayScorer(Scorer):
    """Eq. 22: S_t = λ S_{t-Ω} + u_t. The decay is applied right after an event, so the steps that follow add to
    λ S_{t-Ω} and the next event ranks exactly Eq. 22's value."""

    decay: float = 0.99

    def carry(self, table):
        table.mul_(self.decay)


@dataclass
class PNormScorer(Scorer):
    """Eq. 23: S_t = (Σ_r u_r^p)^(1/p). The table keeps Σ u^p, which sorts the same way."""

    p: float = 3.0
    keeps_interval = True

    def mass_table(self, table, interval):
        return interval

    def settle(self, table, interval):
        table.add_(interval.pow(self.p))
        interval.zero_()

    def ranking(self, table):
        return table.pow(1.0 / self.p)


@dataclass
class KeyNormScorer(Scorer):
    """Eq. 24: S(w) = -mean_i ||k_i||, attention-free; set once when the window leaves the recent region."""

    needs_attention = False
    reads_aged_keys = True

    def on_aged(self, table, window_ids, keys):
        b, h = keys.shape[:2]
        norms = keys.float().norm(dim=-1).reshape(b, h, window_ids.shape[1], -1)  # (B, H, n, Ω)
        per_window = -norms.mean(dim=(1, 3))  # (B, n)
        table.scatter_(1, window_ids.long().expand(b, -1), per_window)

    def mass_table(self, table, interval):
        raise RuntimeError("keynorm needs no attention mass")


def make_scorer(cfg: QEvictConfig) -> Scorer:
    pooling = dict(pool=cfg.pool, pool_weight=cfg.pool_weight, pool_direction=cfg.pool_direction)
    return {
        "cumulative": lambda: CumulativeScorer(**pooling),
        "decay": lambda: DecayScorer(**pooling, decay=cfg.decay),
        "pnorm": lambda: PNormScorer(**pooling, p=cfg.p),
        "keynorm": lambda: KeyNormScorer(),
    }[cfg.scorer]()
