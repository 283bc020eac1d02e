"""Rotary position embedding at arbitrary absolute positions, using the model's own rotary module.

Quantized keys are stored pre-RoPE: un-rotated with their original positions before quantization and re-rotated
after dequantization. Using the model's rotary module keeps every RoPE variant it supports (scaled, llama3, ...).
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Rotates (B, H, T, D) keys at positions (B, T) with the model's rotary embedding."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary

    @classmethod
    def from_model(cls, model: nn.Module) -> Rope:
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                return cls(module)
        raise ValueError(f"{type(model).__name__} has no rotary embedding module; QEvict needs a RoPE model")

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary, "attention_scaling", 1.0))

    def cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(like, positions.long())  # (B, T, D)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): shared by every head

    def table(self, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (length, D) of positions 0 .. length-1: row p is exactly what :meth:`cos_sin` gives for p
        (the rotary module multiplies each position by the inverse frequencies on its own)."""
        cos, sin = self.rotary(like, torch.arange(length, device=like.device)[None])
        return cos[0], sin[0]

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(keys, positions)
        return keys * cos + _rotate_half(keys) * sin

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Exact inverse of :meth:`rotate`, also when the rotary module scales cos and sin (cos² + sin² ≠ 1)."""
        return unrotate(keys, *self.cos_sin(keys, positions))


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:meth:`Rope.unrotate` with cos/sin given, e.g. rows of :meth:`Rope.table` (the same numbers)."""
    return (keys * cos - _rotate_half(keys) * sin) / (cos * cos + sin * sin)
