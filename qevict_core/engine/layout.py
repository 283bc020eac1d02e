"""Index helpers for the one tensor layout used everywhere: (batch, kv_heads, seq, head_dim).

Windows are contiguous runs of Ω tokens after the sinks (``WindowGrid``); positions are never renumbered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def window_token_index(window_idx: torch.Tensor, omega: int) -> torch.Tensor:
    """(B, n) window slots -> (B, n * Ω) token slots, window-major."""
    offsets = torch.arange(omega, device=window_idx.device, dtype=window_idx.dtype)
    return (window_idx.unsqueeze(-1) * omega + offsets).flatten(-2)


def gather_seq(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None,
               flat: bool = False) -> torch.Tensor:
    """Per-row gather along the sequence axis: x (B, H, T, X), index (B, M) -> (B, H, M, X), into ``out`` when
    given; ``flat``: several rows by one flat index (``Backend.gathers_by_flat_index``)."""
    b, h, t, width = x.shape
    if b == 1:  # one row: index_select copies whole rows (4x faster than an elementwise gather on the CPU)
        return torch.index_select(x, 2, index[0].long(), out=out)
    if flat and x.is_contiguous() and (out is None or out.is_contiguous()):
        # Several rows (a batch, or every layer's rows at a stacked routing event, layer_stack.py): the same whole-row
        # copies over (B·H·T, X), by one flat index (about 8x faster on the CPU for 30 rows of SmolLM2's tiers).
        m = index.shape[1]
        first = torch.arange(b * h, device=x.device).view(b, h, 1) * t  # (B, H, 1): row (b, h)'s first slot
        at = (first + index.long().view(b, 1, m)).view(-1)  # (B·H·M,)
        rows = torch.index_select(x.view(b * h * t, width), 0, at, out=None if out is None else out.view(-1, width))
        return rows.view(b, h, m, width) if out is None else out
    return torch.gather(x, 2, index.long()[:, None, :, None].expand(b, h, index.shape[1], width), out=out)


@dataclass(frozen=True)
class WindowGrid:
    """Where the windows lie: the one home of that arithmetic (the layers, routing, the prompt stage, the backends,
    the diagnostics and the studio's drawings all ask here). Window ``w`` covers the absolute positions
    ``[sinks + w·Ω, sinks + (w + 1)·Ω)``; the first ``sinks`` positions belong to no window."""

    sinks: int
    omega: int

    def positions(self, window_ids: torch.Tensor) -> torch.Tensor:
        """(B, n) window ids -> (B, n * Ω) absolute token positions, window-major."""
        return window_token_index(window_ids.long(), self.omega) + self.sinks

    def window_of(self, position: int) -> int:
        """The window holding ``position`` (negative for a sink position)."""
        return (position - self.sinks) // self.omega

    def start(self, window: int) -> int:
        """The first position of ``window``."""
        return self.sinks + window * self.omega

    def count(self, length: int) -> int:
        """Windows that ``length`` tokens reach into (the last may be partial)."""
        return -(-max(length - self.sinks, 0) // self.omega)

    def whole(self, length: int) -> int:
        """Complete windows in the first ``length`` tokens."""
        return max(length - self.sinks, 0) // self.omega

