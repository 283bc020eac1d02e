"""The uncompressed reference: every token in full precision, reported like every other method."""

from __future__ import annotations

import torch

from ..engine.budget import KVShape
from ..engine.cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig


class FullKVLayer(ReportingLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def append(self, key_states, value_states):
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values

    def resident_bytes(self) -> dict[str, int]:
        return {"full": self.keys.nbytes + self.values.nbytes} if self.is_initialized else {}

    def tier_counts(self) -> dict[str, int]:
        return {"sink": 0, "recent": 0, "full": self.seen, "quantized": 0, "evicted": 0}


class FullKVCache(ReportingCache):
    method = "fullkv"
    chunked_prefill = "exact"

    def __init__(self, model, config: QEvictConfig | None, max_length: int, batch_size: int = 1):
        shape = KVShape.from_model(model, batch_size)
        layers = [FullKVLayer(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, budget_bytes=None)
        self.config = config  # what it was made with (make_cache reports it per lane)
