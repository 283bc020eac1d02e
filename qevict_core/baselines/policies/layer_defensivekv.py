from dataclasses import dataclass

from .defensivekv import DefensiveKV


@dataclass
class LayerDefensiveKV(DefensiveKV):
    """DefensiveKV scores with one top-k across all layers and heads: layers that need more context get it.
    The selection waits for the whole prefill, so every layer's prompt is held until then (reported as peak)."""

    label = "Layer-DefensiveKV"
    description = "DefensiveKV with one global top-k across all layers and heads (cross-layer budgets)."
    reference = "Feng et al. ICLR 2026; FFY0/DefensiveKV (layer-wise variant)"
    cross_layer = True
