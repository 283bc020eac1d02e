from dataclasses import dataclass

import torch

from .base import Policy, ScoreInputs, pool_keys


@dataclass
class SnapKV(Policy):
    """Prompt tokens scored by the attention of the last ``window`` prompt queries, pooled along keys.

    Once, after prefill. Scores are averaged over the query heads of a KV group and tokens are stored per KV head
    (the official code repeats KV to query heads first, which stores more bytes).
    """

    label = "SnapKV"
    description = "Keeps the prompt tokens the last prompt queries attend to (pooled), once after prefill."
    reference = "Li et al. NeurIPS 2024; FasterDecoding/SnapKV snapkv_utils.py (window 32, avg-pool 5)"

    kernel: int = 5
    pooling: str = "avg"

    def window_scores(self, inputs: ScoreInputs) -> torch.Tensor:
        """(B, H, candidates): window attention summed over queries, pooled over the candidates (the window's own
        keys are kept anyway and stay out of the pooling), averaged over the GQA group."""
        summed = inputs.probs.sum(dim=3)[..., :inputs.candidates]  # (B, Hkv, G, candidates)
        return pool_keys(summed, self.kernel, self.pooling).mean(dim=2)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return self.window_scores(inputs)
