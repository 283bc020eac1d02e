"""The base of every eviction baseline: a policy scores tokens, the base picks the top-k per head.

Subclasses implement ``score`` (higher = keep) and declare what they need as class attributes; the cache
(``qevict_core.baselines.eviction``) never asks which policy it runs, only what it declares:

- ``compress_at``: "prefill" (once, after the prompt; decoded tokens then roll) or "step" (after every forward)
- ``scores_from``: "window" (attention of the last ``window`` prompt queries), "all" (attention of every query,
  accumulated) or "none" (position only)
- ``ragged``: heads keep different numbers of tokens (per-head budgets, memory freed per head)
- ``cross_layer``: one selection across all layers, made after the whole prefill
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ...engine.shared_work import shared


@dataclass
class ScoreInputs:
    """What a policy may read. Layout (B, H, N, D); N = prompt tokens (prefill) or cached tokens (step).

    Candidates are the first ``candidates`` tokens; the rest (the observation window / recent tail) are kept anyway.
    """

    keys: torch.Tensor
    values: torch.Tensor
    module: torch.nn.Module  # the attention module: o_proj for value-aware scores, num_key_value_groups
    keep: int  # tokens to keep per head among the candidates (uniform allocation)
    candidates: int
    probs: torch.Tensor | None = None  # (B, Hkv, G, w, N) observation-window attention ("window")
    accumulated: torch.Tensor | None = None  # (B, Hkv, N) accumulated attention ("all")


@dataclass
class Policy:
    label: ClassVar[str] = ""
    description: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    compress_at: ClassVar[str] = "prefill"
    scores_from: ClassVar[str] = "window"
    ragged: ClassVar[bool] = False
    cross_layer: ClassVar[bool] = False

    window: int = 32  # observation window (prefill policies) or protected recent tokens (step policies)

    # A step policy whose ``score`` is the accumulated attention itself (H2O): its cache can keep that score per
    # slot and evict in place, one token per step (eviction_heavy.py)
    evicts_by_accumulation: ClassVar[bool] = False

    @property
    def decodes_in_place(self) -> bool:
        """Whether its cache can decode in fixed buffers, one call at every step: one selection after the prompt,
        nothing scored while decoding (eviction_fixed.py; eviction_ragged.py where heads keep different counts), or
        the same count in every head evicted in place by accumulated attention (eviction_heavy.py)."""
        if self.compress_at == "step":
            return self.evicts_by_accumulation and not self.ragged and not self.cross_layer
        return self.scores_from != "all"

    @classmethod
    def from_config(cls, config) -> Policy:
        """The policy a lane of this config runs (a policy that reads a QEvictConfig field overrides this)."""
        return cls()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """(B, H, >= candidates) ranking; the caller reads the first ``candidates`` columns."""
        raise NotImplementedError

    def min_capacity(self) -> int:
        return self.window + 1

    def split(self, capacity: int, reserve: int) -> tuple[int, int]:
        """Per head: (tokens chosen by score, protected tail) at prefill, leaving ``reserve`` slots for decoding."""
        tail = min(self.window, capacity)
        return max(0, capacity - reserve - tail), tail

    def allocate(self, scores: torch.Tensor, keep: int) -> list[int]:
        """Tokens each head keeps, for batch row 0's scores (B, H, N): uniform unless overridden."""
        return [min(keep, scores.shape[2])] * scores.shape[1]

    def select(self, scores: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Per head, the indices (B, k_h) of its top-k_h candidates, in ascending (chronological) order."""
        return [scores[:, h].topk(k, dim=-1).indices.sort(dim=-1).values for h, k in enumerate(counts)]


def global_allocation(scores: torch.Tensor, total: int) -> list[int]:
    """Split ``total`` slots over heads by one top-k across all heads (batch row 0)."""
    h, n = scores.shape[1], scores.shape[2]
    total = min(total, h * n)
    top = scores[0].reshape(-1).topk(total).indices // n
    return torch.bincount(top, minlength=h).tolist()


def pool_keys(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Smooth scores (..., N) along the key axis, same length (SnapKV's clustering step)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        # the padding counts in the mean, as F.avg_pool1d's default in SnapKV's code and kvpress
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=pad)
    return pooled[..., :shape[-1]].reshape(shape)


@shared
def value_norms(values: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """CriticalKV's value term N_j = ||W_o^h v_j||_1, averaged over the query heads h of each KV group.

    values (B, Hkv, N, D) -> (B, Hkv, N). W_o^h is query head h's slice of o_proj (hidden, D).
    """
    b, hkv, n, d = values.shape
    groups = module.num_key_value_groups
    w_o = module.o_proj.weight.float().reshape(-1, hkv, groups, d)  # (hidden, Hkv, G, D)
    out = torch.empty(b, hkv, n, dtype=torch.float32, device=values.device)
    for start in range(0, n, 1024):  # bounds the (B, Hkv, G, chunk, hidden) product
        part = values[:, :, start:start + 1024].float()
        projected = torch.einsum("bhnd,ohgd->bhgno", part, w_o)
        out[:, :, start:start + 1024] = projected.abs().sum(dim=-1).mean(dim=2)
    return out
