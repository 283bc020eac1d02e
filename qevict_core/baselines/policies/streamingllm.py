from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, ScoreInputs


@dataclass
class StreamingLLM(Policy):
    """Attention sinks + a rolling window of recent tokens; everything between is dropped.

    The sinks are the kept "selection"; the rest of the capacity is the protected tail, which rolls (FIFO) as
    tokens are decoded. Keys keep their original RoPE positions (as kvpress does), not positions inside the cache.
    """

    label = "StreamingLLM"
    description = "Attention sinks + the most recent tokens; the middle of the context is dropped."
    reference = "Xiao et al. ICLR 2024; mit-han-lab/streaming-llm StartRecentKVCache"
    scores_from = "none"

    sinks: int = 4

    @classmethod
    def from_config(cls, config) -> StreamingLLM:
        return cls(sinks=config.sinks)

    def min_capacity(self) -> int:
        return self.sinks + 1

    def split(self, capacity: int, reserve: int) -> tuple[int, int]:
        return min(self.sinks, capacity), capacity - min(self.sinks, capacity)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, h, n, _ = inputs.keys.shape
        return -torch.arange(n, dtype=torch.float32, device=inputs.keys.device).expand(b, h, n)
