from dataclasses import dataclass

import torch

from .base import Policy, ScoreInputs, global_allocation, value_norms


@dataclass
class DefensiveKV(Policy):
    """Defensive aggregation against uncertain future attention.

    1. window attention, average-pooled along keys (kernel 5) with each row rescaled to keep its sum;
    2. m_j = max over the GQA group and the window queries; s_j = max(m_j, mean m) per KV head;
    3. CriticalKV weighting s_j <- s_j * N_j / sum over KV heads of N_j (heads become comparable);
    4. the top tokens holding 90% of the mean attention (less what the window gives itself) are protected,
       at most the head's uniform share, by raising them to the layer's maximum score;
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
        probs = inputs.probs[..., :n]  # (B, Hkv, G, w, n): window rows, softmax taken over every key
        pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, n), self.kernel, stride=1,
                                                padding=self.kernel // 2, count_include_pad=False)
        pooled = pooled[..., :n].reshape(probs.shape)
        pooled = pooled * (probs.sum(-1, keepdim=True) / pooled.sum(-1, keepdim=True).clamp_min(1e-12))
        m = pooled.amax(dim=(2, 3))  # (B, Hkv, n)
        s = torch.maximum(m, m.mean(dim=-1, keepdim=True))
        # Value weighting normalised across the KV heads of each token, so one top-k can compare heads.
        norms = value_norms(inputs.values[:, :, :n], inputs.module)
        s = s * norms / norms.sum(dim=1, keepdim=True)
        # Protect the shortest top set holding 90% of the attention that did not go to the window itself.
        window_bias = inputs.probs[..., n:].sum(-1).mean().item()
        mean_mass = probs.mean(dim=(2, 3))
        order = mean_mass.sort(dim=-1, descending=True)
        cumulative = order.values.cumsum(-1) / mean_mass.sum(-1, keepdim=True).clamp_min(1e-12)
        count = (cumulative < self.protect_mass - window_bias).sum(-1, keepdim=True).clamp(max=inputs.keep)
        ranks = torch.arange(n, device=s.device).expand_as(order.indices)
        protect = torch.zeros_like(s, dtype=torch.bool).scatter(-1, order.indices, ranks < count)
        return torch.where(protect, s.amax(), s)

    def allocate(self, scores: torch.Tensor, keep: int) -> list[int]:
        return global_allocation(scores, scores.shape[1] * keep)
