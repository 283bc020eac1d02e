"""Window ranking functions (Section 4.2 and Appendix J).

A scorer owns one float32 table per layer, ``(B, num_windows)``, indexed by window id. Attention-based scorers
see ``u_t(w)``, the attention mass a window received from the queries since the previous routing event (Eq. 20),
one step at a time: ``fold`` adds a step's mass as it runs, ``settle`` finishes the table before a routing event
ranks it and ``carry`` prepares it for the next interval. Only a scorer that transforms a whole interval's mass
(``keeps_interval``, Eq. 23's power) needs that mass apart from the table until the event: a second (B, W) table,
charged to the budget like the first. ``ranking`` turns the table into the key that routing sorts by, and ``rank``
pools that key over neighbouring windows at every event when the config asks for it.

A scorer is one file in this package: a ``Scorer`` subclass with a ``name`` (the value of ``QEvictConfig.scorer``
that selects it); ``scorers/__init__.py`` finds it, and the config, the CLI, the studio and the registry's
``qevict_<name>`` ablation list it. Its own settings are a ``PARAMETERS`` literal in its module (decay.py shows
one): each becomes a ``QEvictConfig`` field, read without importing the module (``qevict_core/scorer_files.py``),
and a field of the class of the same name, which ``from_config`` fills.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ...config import QEvictConfig


# A neighbour ranks just below the window it borrows from, so the window itself still comes first.
POOL_TIE = 1e-3


@dataclass
class Scorer:
    name: ClassVar[str] = ""  # the config's ``scorer`` value; a class without one is a base, never listed
    needs_attention = True  # False: ranks without attention mass (so it cannot be pooled)
    # ``fold`` adds a step's mass into ``mass_table`` and does nothing else, so a kernel may add it there itself
    # (the fused path's score_fold); a scorer whose fold does more says False
    folds_by_adding = True
    keeps_interval = False
    reads_aged_keys = False  # on_aged does something: it needs the keys of windows leaving the recent region
    pool: int = 0
    pool_weight: float = 1.0
    pool_direction: str = "both"

    @classmethod
    def from_config(cls, cfg: QEvictConfig) -> Scorer:
        """This scorer with the config's pooling (attention scorers) and its own settings (its module's
        ``PARAMETERS``, fields of the config)."""
        own = {name: getattr(cfg, name) for name in getattr(sys.modules[cls.__module__], "PARAMETERS", {})}
        if not cls.needs_attention:
            return cls(**own)
        return cls(pool=cfg.pool, pool_weight=cfg.pool_weight, pool_direction=cfg.pool_direction, **own)

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
