from dataclasses import dataclass

import torch

from .base import ScoreInputs, value_norms
from .snapkv import SnapKV


@dataclass
class CriticalKV(SnapKV):
    """Value-aware two-stage selection on SnapKV scores: half of each head's budget by attention score, the rest
    by (score + ε) · ||W_o^h v_j||_1, the token's contribution to the output."""

    label = "CriticalKV"
    description = "SnapKV scores reweighted by each value's output norm through o_proj (two-stage)."
    reference = "Feng et al. 2025 (arXiv 2502.03805); kvpress criticalkv_press.py"

    first_stage: float = 0.5
    epsilon: float = 1e-4

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        # The mean over the window's queries, as kvpress's SnapKV scores are, so that ε weighs what it weighs there
        base = self.window_scores(inputs)[:, :, :inputs.candidates] / inputs.probs.shape[3]
        # The first stage is a share of everything kept, observation window included (it outranks every candidate
        # there), as kvpress's CriticalKVPress counts it: its candidates are that share less the window.
        window = inputs.keys.shape[2] - inputs.candidates
        stage1 = max(0, min(inputs.candidates, int((inputs.keep + window) * self.first_stage) - window))
        weighted = (base + self.epsilon) * value_norms(inputs.values[:, :, :inputs.candidates], inputs.module)
        first = torch.zeros_like(base, dtype=torch.bool)
        if stage1:
            first.scatter_(2, base.topk(stage1, dim=2).indices, True)
        # Stage-1 tokens outrank every stage-2 token; the rest compete on the value-weighted score.
        return torch.where(first, weighted.amax(dim=2, keepdim=True) + 1 + base, weighted)
