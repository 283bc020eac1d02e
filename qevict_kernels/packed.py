"""What the kernels read of a low-bit tier, declared structurally: any object with these tensors is a tier
(the engine's ``WindowLedger`` is one), so ``kernels`` never imports the engine.

Layout per (batch, KV head): window ``i`` holds tokens ``sinks + ids[i]·Ω + (0..Ω-1)``; codes are packed in bit
planes (``qevict_core.engine.quant``); keys are stored before RoPE and re-rotated at their positions."""

from __future__ import annotations

from typing import Protocol

import torch


class PackedWindows(Protocol):
    k_codes: torch.Tensor   # (B, H, n·Ω, D·bits/8) uint8
    k_scale: torch.Tensor   # (B, H, n, D): per window and channel
    k_zero: torch.Tensor
    v_codes: torch.Tensor   # (B, H, n·Ω, D·bits/8) uint8
    v_scale: torch.Tensor   # (B, H, n·Ω, 1): per token
    v_zero: torch.Tensor
    ids: torch.Tensor       # (B, n) window ids
    num_windows: int
    omega: int
    bits: int

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pre-RoPE keys, values), each (B, H, n·Ω, D)."""


def window_positions(ids: torch.Tensor, sinks: int, omega: int) -> torch.Tensor:
    """(B, n) window ids -> (B, n·Ω) absolute token positions."""
    return (ids.long().unsqueeze(-1) * omega + torch.arange(omega, device=ids.device)).flatten(-2) + sinks
