from dataclasses import dataclass

import torch

from .base import Policy, ScoreInputs, global_allocation, value_norms


@dataclass
class DefensiveKV(Policy):
    """Defensive aggregation against uncertain future attention.

    1. window attention, average-pooled along keys (kernel 5) with each row rescaled to keep its sum;
    2. m_j = max over the GQA group and the window queries; s_j = max(m_j, mean m) per KV head;
    3. CriticalKV weighting s_j <- s_j * N_j / sum N;
    4. the shortest top prefix holding >= 90% of the mean attention mass is protected (set to the max score);
    5. one top-k across the layer's heads (per-head budgets, freed per head).
    """

    label = "DefensiveKV"
    description = ("Max-aggregated window attention, value-weighted, with a protected high-mass prefix; "
                   "per-head budgets.")
    reference = "Feng et al. ICLR 2026; FFY0/DefensiveKV efficient_defensivekv_press.py"
    ragged = True

    kernel: int = 5
    protect_mass: float = 0.9

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        n = inputs.candidates
        probs = inputs.probs[..., :n]  # (B, Hkv, G, w, n)
        pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, n), self.kernel, stride=1,
                                                padding=self.kernel // 2, count_include_pad=False)
        pooled = pooled[..., :n].reshape(probs.shape)
        pooled = pooled * (probs.sum(-1, keepdim=True) / pooled.sum(-1, keepdim=True).clamp_min(1e-12))
        m = pooled.amax(dim=(2, 3))  # (B, Hkv, n)
        s = torch.maximum(m, m.mean(dim=-1, keepdim=True))
        norms = value_norms(inputs.values[:, :, :n], inputs.module)
        s = s * norms / norms.sum(dim=-1, keepdim=True)
        mean_mass = probs.mean(dim=(2, 3))
        order = mean_mass.sort(dim=-1, descending=True)
        cumulative = order.values.cumsum(-1) / mean_mass.sum(-1, keepdim=True).clamp_min(1e-12)
        protect = torch.zeros_like(s, dtype=torch.bool).scatter(-1, order.indices,
                                                                 (cumulative - order.values) < self.protect_mass)
        return torch.where(protect, s.amax(dim=-1, keepdim=True), s)

    def allocate(self, scores: torch.Tensor, keep: int) -> list[int]:
        return global_allocation(scores, scores.shape[1] * keep)
