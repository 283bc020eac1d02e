from dataclasses import dataclass

import torch

from .base import Policy, ScoreInputs


@dataclass
class H2O(Policy):
    """Heavy hitters: accumulated attention over every query seen (prompt rows and each decode step), recomputed
    after every forward; keeps the last ``window`` tokens plus the highest-scoring rest, per KV head (scores
    averaged over the GQA group; the official code assumes MHA)."""

    label = "H2O"
    description = "Keeps the recent tokens plus the heavy hitters by accumulated attention, evicting every step."
    reference = "Zhang et al. NeurIPS 2023; FMInference/H2O H2OKVCache_LayerWise (heavy = recent = half)"
    compress_at = "step"
    scores_from = "all"
    evicts_by_accumulation = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.accumulated

    def min_capacity(self) -> int:
        return 2

    def split(self, capacity: int, reserve: int) -> tuple[int, int]:
        """heavy_ratio = recent_ratio: half of the capacity each (the paper's 10% + 10% setting)."""
        return capacity - capacity // 2, capacity // 2
