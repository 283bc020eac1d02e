"""Index helpers for the one tensor layout used everywhere: (batch, kv_heads, seq, head_dim).

Windows are contiguous runs of Ω tokens. Window ``w`` of a layer covers absolute positions
``[sinks + w * Ω, sinks + (w + 1) * Ω)``; positions are never renumbered.
"""

from __future__ import annotations

import torch


def window_token_index(window_idx: torch.Tensor, omega: int) -> torch.Tensor:
    """(B, n) window slots -> (B, n * Ω) token slots, window-major."""
    offsets = torch.arange(omega, device=window_idx.device, dtype=window_idx.dtype)
    return (window_idx.unsqueeze(-1) * omega + offsets).flatten(-2)


def gather_seq(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-row gather along the sequence axis: x (B, H, T, X), index (B, M) -> (B, H, M, X)."""
    b, h, _, width = x.shape
    if b == 1:  # one row: index_select copies whole rows (4x faster than an elementwise gather on the CPU)
        return x.index_select(2, index[0].long())
    return x.gather(2, index.long()[:, None, :, None].expand(b, h, index.shape[1], width))


def window_positions(window_ids: torch.Tensor, sinks: int, omega: int) -> torch.Tensor:
    """(B, n) window ids -> (B, n * Ω) absolute token positions."""
    return window_token_index(window_ids.long(), omega) + sinks

