"""Byte budgets and tier capacities (Eq. 3, 7 and 8 of the paper).

Every persistent tensor a layer keeps is charged here with the same constructors the layer uses, so the plan and
the measured ``memory_report()`` cannot drift apart: full-precision K/V, packed codes, scales and zero-points,
window ids, dormant-ledger flags and the scorer's tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import QEvictConfig
from .layout import WindowGrid
from .ledger import WindowLedger

ID_BYTES = torch.empty(0, dtype=torch.int32).element_size()
SCORE_BYTES = torch.empty(0, dtype=torch.float32).element_size()
FLAG_BYTES = torch.empty(0, dtype=torch.bool).element_size()


@dataclass(frozen=True)
class KVShape:
    """What the KV cache of one model at one batch size looks like; ``dtype`` is what it stores full-precision keys
    and values in (every byte count here is in it)."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype
    batch: int = 1

    @classmethod
    def from_model(cls, model, batch: int = 1, config: QEvictConfig | None = None) -> KVShape:
        """``dtype``: what the cache stores keys and values in, ``config.kv_dtype`` (16 bits by default); without a
        config, the model's own dtype (a view of a model that stores its cache itself, as vLLM does)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            num_q_heads=cfg.num_attention_heads,
            head_dim=head_dim,
            dtype=config.storage_dtype(model.dtype) if config is not None else model.dtype,
            batch=batch,
        )

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def token_bytes(self) -> int:
        """Full-precision K and V of one token in one layer."""
        return 2 * self.batch * self.num_kv_heads * self.head_dim * self.element_size

    def fullkv_bytes(self, tokens: int) -> int:
        """Eq. 7: the uncompressed cache of ``tokens`` tokens over all layers."""
        return self.num_layers * self.token_bytes() * tokens


def quant_window_bytes(shape: KVShape, omega: int, bits: int, param_dtype: torch.dtype | None = None) -> int:
    ledger = WindowLedger.empty(shape.batch, shape.num_kv_heads, shape.head_dim, omega, bits,
                                param_dtype or shape.dtype, device="meta", num_windows=1)
    return sum(ledger.nbytes_by_component().values())


class BudgetTooSmall(ValueError):
    """A byte budget below what a method needs to run at all; ``needed_bytes`` is the least it can run with and
    ``reason`` says in plain words what takes that much. ``fittable``: running at ``needed_bytes`` instead is what
    the caller asked for in spirit (what the method always keeps does not fit); False when the caller fixed what
    does not fit (tier capacities), which ``make_cache`` never overrides."""

    def __init__(self, message: str, needed_bytes: int, reason: str, fittable: bool = True):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.reason = reason
        self.fittable = fittable


def budget_bytes_of(shape: KVShape, cfg: QEvictConfig, max_length: int) -> int:
    return cfg.budget_bytes if cfg.budget_bytes is not None else int(cfg.budget * shape.fullkv_bytes(max_length))


@dataclass(frozen=True)
class TierPlan:
    """Per-layer capacities for one generation of at most ``max_length`` tokens."""

    max_length: int
    budget_bytes: int
    num_windows: int
    k_full: int
    k_quant: int
    keeps_dormant: bool
    fixed_bytes: int  # per layer: sinks, recent region with Ω pending tokens, score tables
    full_window_bytes: int  # per layer and window, dormant-ledger reservation included when kept
    quant_window_bytes: int
    # The budget holds every token of max_length uncompressed: no windows, scores or routing, so the cache is
    # FullKV itself (same attention, same bytes) rather than FullKV plus bookkeeping.
    uncompressed: bool = False


def plan_tiers(shape: KVShape, cfg: QEvictConfig, max_length: int, interval_table: bool = False) -> TierPlan:
    """``interval_table``: the scorer keeps an interval's mass in a second (B, W) table (see scorers/scorer_base.py)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1 (got {max_length})")
    budget = budget_bytes_of(shape, cfg, max_length)
    num_windows = WindowGrid(cfg.sinks, cfg.omega).count(max_length)
    if budget >= shape.fullkv_bytes(max_length):
        return TierPlan(max_length, budget, num_windows, num_windows, 0, False, 0, 0, 0, uncompressed=True)
    # The recent region holds up to recent + Ω - 1 tokens after routing, plus Ω arriving before the next event.
    fp_tokens = min(cfg.sinks + cfg.recent + 2 * cfg.omega - 1, max_length)
    fixed = fp_tokens * shape.token_bytes() + (2 if interval_table else 1) * shape.batch * num_windows * SCORE_BYTES
    hist = budget // shape.num_layers - fixed
    if hist < 0:
        least = min(shape.num_layers * fixed, shape.fullkv_bytes(max_length))
        raise BudgetTooSmall(
            f"budget of {budget} bytes cannot hold the protected regions: sinks={cfg.sinks}, recent={cfg.recent} and "
            f"Ω={cfg.omega} pending tokens need {least} bytes ({least / shape.fullkv_bytes(max_length):.3f} of the "
            f"full cache at max_length={max_length}); raise the budget or lower sinks/recent/omega", least,
            f"its always-kept tokens ({cfg.sinks} sinks, {cfg.recent} recent and up to {2 * cfg.omega - 1} arriving "
            f"between routing events) and its window scores need that much")
    m_full = cfg.omega * shape.token_bytes() + shape.batch * ID_BYTES
    m_quant = quant_window_bytes(shape, cfg.omega, cfg.bits, cfg.param_dtype(shape.dtype))
    m_dormant = m_quant + shape.batch * FLAG_BYTES
    keeps_dormant = cfg.promotion and (cfg.q_frac > 0 or cfg.coverage is not None)
    m_f = m_full + (m_dormant if keeps_dormant else 0)
    if cfg.k_full is not None:
        return _fixed_capacities(shape, cfg, max_length, budget, num_windows, fixed, m_full, m_dormant, m_quant,
                                 keeps_dormant)
    if cfg.coverage is None:
        k_full = math.floor((1 - cfg.q_frac) * hist / m_f)
        k_quant = math.floor(cfg.q_frac * hist / m_quant)
    else:
        # round() first: 0.7 * 250 must give 175 windows, not 176 from a product a hair above it.
        k_quant = min(math.ceil(round(cfg.coverage * num_windows, 9)), hist // m_quant)
        k_full = (hist - k_quant * m_quant) // m_f
    if k_full + k_quant > num_windows:
        # Eq. 3 would reserve quantized slots no sequence of this length can fill: spend the surplus on full
        # precision instead (the largest k_full with k_full * m_f + (W - k_full) * m_quant <= hist).
        k_full = min(num_windows, max(0, (hist - num_windows * m_quant) // (m_f - m_quant)))
        k_quant = num_windows - k_full
    if k_quant == 0 and keeps_dormant:
        keeps_dormant, m_f = False, m_full
        k_full = min(num_windows, hist // m_f)
    return TierPlan(max_length, budget, num_windows, k_full, k_quant, keeps_dormant, fixed, m_f, m_quant)


def _fixed_capacities(shape: KVShape, cfg: QEvictConfig, max_length: int, budget: int, num_windows: int, fixed: int,
                      m_full: int, m_dormant: int, m_quant: int, keeps_dormant: bool) -> TierPlan:
    """The plan for capacities given in the config, if the budget holds them; otherwise an error itemising what
    one layer needs against what it gets."""
    k_full = min(cfg.k_full, num_windows)
    k_quant = min(cfg.k_quant, num_windows - k_full)
    keeps_dormant = keeps_dormant and k_quant > 0  # nothing can be promoted without a quantized tier
    m_f = m_full + (m_dormant if keeps_dormant else 0)
    per_layer = budget // shape.num_layers
    needed = fixed + k_full * m_f + k_quant * m_quant
    if needed > per_layer:
        total = needed * shape.num_layers
        ledger = " (window bytes include the dormant ledger record each full window may hold)" if keeps_dormant else ""
        raise BudgetTooSmall(
            f"K_f={k_full}, K_q={k_quant} need {needed} bytes per layer but the budget gives {per_layer}: "
            f"{fixed} for sinks, recent region, the {2 * cfg.omega - 1} tokens arriving between routing events and "
            f"the score table, {k_full} x {m_f} for full windows{ledger} and {k_quant} x {m_quant} for quantized "
            f"windows. {needed - per_layer} bytes per layer are missing: they need {total} bytes in all "
            f"({total / shape.fullkv_bytes(max_length):.3f} of the full cache), the budget is {budget}", total,
            f"K_f={k_full} full and K_q={k_quant} quantized windows per layer need that much", fittable=False)
    return TierPlan(max_length, budget, num_windows, k_full, k_quant, keeps_dormant, fixed, m_f, m_quant)
