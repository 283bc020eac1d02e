"""``make_cache(method, ...)``: every method the studio and the benchmarks can run, by name.

All methods take the same ``QEvictConfig``; each reads what it needs (the budget always), so a comparison at one
config is a comparison at the same ``budget_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .budget import BudgetTooSmall, KVShape, plan_tiers
from .cache import QEvictCache
from .cache_base import ReportingCache
from .config import QEvictConfig
from .eviction import EvictionCache
from .fullkv import FullKVCache
from .head_cache import HeadwiseQEvictCache
from .kivi import KIVICache
from .kvquant import KVQuantCache
from .padded import RowCache
from .policies import H2O, AdaKV, CriticalKV, DefensiveKV, LayerDefensiveKV, Policy, SnapKV, StreamingLLM
from .scorers import make_scorer
from .zipcache import ZipCacheCache


@dataclass(frozen=True)
class MethodSpec:
    build: Callable[..., ReportingCache]
    description: str
    reference: str
    family: str  # "reference", "qevict", "eviction" or "quantization"


def _qevict(name: str, same_capacity: bool = False, **overrides) -> Callable[..., ReportingCache]:
    """``same_capacity``: an ablation runs with the tier capacities that QEvict gets from the same config (as the
    paper's Appendix K does), not with what its own byte needs would give (without promotion no full window
    reserves a ledger record, so Eq. 3 would hand it more full windows and the ablation would measure that too).
    An ablation of Ω keeps the same capacity in tokens: K·Ω / Ω', rounded down to whole windows. When that
    capacity does not fit the bytes (smaller windows carry more scales and scores; p-norm keeps a second table),
    the ablation runs at its own plan for the same bytes, and its K_f / K_q (in ``summary()``) say so."""
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        cache = None
        if same_capacity and config.k_full is None:
            plan = plan_tiers(KVShape.from_model(model, batch_size), config, max_length,
                              interval_table=make_scorer(config).keeps_interval)
            if not plan.uncompressed:
                omega = overrides.get("omega", config.omega)
                fixed = config.replace(k_full=plan.k_full * config.omega // omega,
                                       k_quant=plan.k_quant * config.omega // omega, **overrides)
                try:
                    cache = QEvictCache(model, fixed, max_length, batch_size)
                except BudgetTooSmall:
                    pass  # its own plan, below
        if cache is None:
            cache = QEvictCache(model, config.replace(**overrides), max_length, batch_size)
        cache.method = name
        return cache
    return build


def _qevict_head(name: str, **overrides) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        cache = HeadwiseQEvictCache(model, config.replace(**overrides), max_length, batch_size)
        cache.method = name
        return cache
    return build


def _evict(name: str, make_policy: Callable[[QEvictConfig], Policy]) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        return EvictionCache(model, config, max_length, batch_size, make_policy(config), name)
    return build


def _kivi(bits: int) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        return KIVICache(model, config, max_length, batch_size, bits=bits)
    return build


def _kvquant(bits: int) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        return KVQuantCache(model, config, max_length, batch_size, bits=bits)
    return build


def _policy_spec(name: str, make_policy: Callable[[QEvictConfig], Policy], cls: type[Policy]) -> MethodSpec:
    return MethodSpec(_evict(name, make_policy), cls.description, cls.reference, "eviction")


METHODS: dict[str, MethodSpec] = {
    "fullkv": MethodSpec(FullKVCache, "Uncompressed cache: every token in full precision (the reference).",
                         "transformers DynamicCache semantics", "reference"),
    "qevict": MethodSpec(_qevict("qevict"), "QEvict: windows routed by cumulative attention into full precision, a "
                         "recoverable INT2/INT4 tier or eviction, with promotion.", "arXiv 2608.05326, Alg. 1",
                         "qevict"),
    "qevict_paper": MethodSpec(_qevict("qevict_paper", prefill_window=0), "QEvict, the paper's preset "
                               "(QEvictConfig.paper()): prefill scores summed over every prompt query (Eq. 1) instead "
                               "of the last 32.", "arXiv 2608.05326, Sec. 5 and App. B.5", "qevict"),
    "qevict_int4": MethodSpec(_qevict("qevict_int4", bits=4), "QEvict with an INT4 recoverable tier: fewer low-bit "
                              "windows for the same bytes, each four times finer (the paper's Appendix G trade-off).",
                              "arXiv 2608.05326, App. G", "qevict"),
    "qevict_int4_f16scale": MethodSpec(_qevict("qevict_int4_f16scale", bits=4, scale_dtype="float16"),
                                       "qevict_int4 with its scales and zero-points stored in float16: on a float32 "
                                       "model they are half a window's bytes, so the same budget holds more INT4 "
                                       "windows.", "arXiv 2608.05326, App. G; see docs/engine.md", "qevict"),
    "qevict_cover": MethodSpec(_qevict("qevict_cover", bits=4, scale_dtype="float16", coverage=0.7),
                               "qevict_int4_f16scale with coverage first: the INT4 tier is sized to hold 70% of the "
                               "windows (all of the historical bytes where it cannot) and only the bytes left over "
                               "buy full windows; q is not used.", "arXiv 2608.05326, Eq. 3 and App. G; see "
                               "docs/engine.md", "qevict"),
    "qevict_pool": MethodSpec(_qevict("qevict_pool", pool=1), "QEvict with neighbour pooling: a window ranks by the "
                              "largest score of itself and its two neighbours (pool = 1), as SnapKV and AdaKV pool "
                              "attention; routed per layer (qevict_head_pool's control).",
                              "arXiv 2608.05326 + SnapKV's pooling; see docs/engine.md", "qevict"),
    "qevict_head": MethodSpec(_qevict_head("qevict_head", pool=1, pool_direction="forward", pool_weight=0.1,
                                           head_floor=1.0),
                              "QEvict routed per KV head: each head ranks windows by its query group's attention "
                              "blended with the layer's (β = 0.5), a window borrowing a tenth of the score of the "
                              "window before it (forward pooling, γ = 0.1), every head at the layer's capacities "
                              "(floor α = 1; the AdaKV split is head_floor < 1).",
                              "arXiv 2608.05326 + Feng et al. 2024 (AdaKV); see qevict_core/head_cache.py", "qevict"),
    "qevict_head_pool": MethodSpec(_qevict_head("qevict_head_pool", pool=1), "qevict_head's earlier form: pooled "
                                   "over both neighbours at full weight (pool = 1, γ = 1) and the layer's slots split "
                                   "over heads AdaKV-style at every routing event (floor α = 0.2).",
                                   "qevict_core/head_cache.py; docs/engine.md", "qevict"),
    "qevict_head_nopool": MethodSpec(_qevict_head("qevict_head_nopool"), "qevict_head ablation without pooling "
                                     "(pool = 0), AdaKV split (α = 0.2): its form before pooling.", "qevict_core/head_cache.py", "qevict"),
    "qevict_head_own": MethodSpec(_qevict_head("qevict_head_own", head_blend=0.0), "qevict_head ablation: each head "
                                  "ranks by its own query group's attention alone (β = 0), without pooling (its first "
                                  "form).", "qevict_core/head_cache.py", "qevict"),
    "qevict_nopromo": MethodSpec(_qevict("qevict_nopromo", same_capacity=True, promotion=False),
                                 "QEvict one-way ablation: Full -> Quantized -> Evicted, no promotion, at QEvict's "
                                 "tier capacities.", "arXiv 2608.05326, App. K", "qevict"),
    **{f"qevict_{scorer}": MethodSpec(_qevict(f"qevict_{scorer}", same_capacity=True, scorer=scorer),
                                      f"QEvict scorer ablation: windows ranked by the {scorer} score (Appendix J) "
                                      "at QEvict's tier capacities.", "arXiv 2608.05326, App. J/K", "qevict")
       for scorer in ("decay", "pnorm", "keynorm")},
    **{f"qevict_omega{omega}": MethodSpec(_qevict(f"qevict_omega{omega}", same_capacity=True, omega=omega),
                                          f"QEvict window-size ablation: Ω = {omega} (windows and routing interval) "
                                          "at QEvict's tier capacities in tokens.", "arXiv 2608.05326, App. K",
                                          "qevict")
       for omega in (4, 16)},
    "r1": MethodSpec(_qevict("r1", omega=1, q_frac=0.0), "R1: token-level eviction by cumulative attention "
                     "(Ω = 1, no quantized tier).", "arXiv 2608.05326, App. I.1", "qevict"),
    "r2": MethodSpec(_qevict("r2", q_frac=0.0), "R2: two-tier window eviction (Ω = 8, no quantized tier).",
                     "arXiv 2608.05326, App. I.1", "qevict"),
    "streamingllm": _policy_spec("streamingllm", lambda c: StreamingLLM(sinks=c.sinks), StreamingLLM),
    "h2o": _policy_spec("h2o", lambda c: H2O(), H2O),
    "snapkv": _policy_spec("snapkv", lambda c: SnapKV(), SnapKV),
    "adakv": _policy_spec("adakv", lambda c: AdaKV(), AdaKV),
    "criticalkv": _policy_spec("criticalkv", lambda c: CriticalKV(), CriticalKV),
    "defensivekv": _policy_spec("defensivekv", lambda c: DefensiveKV(), DefensiveKV),
    "layer_defensivekv": _policy_spec("layer_defensivekv", lambda c: LayerDefensiveKV(), LayerDefensiveKV),
    "kivi2": MethodSpec(_kivi(2), "KIVI-2: every token kept, keys per-channel and values per-token in 2 bits, "
                        "a 32-token fp residual.", "Liu et al. 2024; jy-yuan/KIVI (G=32, R=32)", "quantization"),
    "kivi4": MethodSpec(_kivi(4), "KIVI-4: as KIVI-2 with 4-bit codes.", "Liu et al. 2024; jy-yuan/KIVI",
                        "quantization"),
    "kvquant2": MethodSpec(_kvquant(2), "KVQuant-2b (s1%): pre-RoPE per-channel keys, per-token values, 2-bit "
                           "non-uniform levels, 1% sparse outliers kept exactly, the first token in full precision.",
                           "Hooper et al. 2024; SqueezeAILab/KVQuant (levels and key thresholds calibrated on the "
                           "prompt)", "quantization"),
    "kvquant4": MethodSpec(_kvquant(4), "KVQuant-4b (s1%): as KVQuant-2b with 4-bit non-uniform levels.",
                           "Hooper et al. 2024; SqueezeAILab/KVQuant", "quantization"),
    "zipcache": MethodSpec(ZipCacheCache, "ZipCache: every token kept; per head, the 40% with the highest "
                           "normalised attention in 4 bits, the rest in 2 bits; decoded tokens compressed 100 at a time.",
                           "He et al. 2024; ThisisBillhe/ZipCache (exact saliency instead of probe tokens)",
                           "quantization"),
}


def list_methods() -> dict[str, str]:
    return {name: spec.description for name, spec in METHODS.items()}


def method_info(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {sorted(METHODS)}")
    return METHODS[name]


def make_cache(method: str, model, config: QEvictConfig | None = None, max_length: int | None = None,
               batch_size: int = 1, padded: bool = False) -> ReportingCache:
    """A fresh cache of ``method`` for one generation of at most ``max_length`` tokens (prompt + new tokens).

    ``padded``: the batch may be left-padded (prompts of different lengths): one cache per row, each seeing only
    its row's tokens, so every row generates what its prompt generates alone (padded.py)."""
    spec = method_info(method)
    if max_length is None or max_length < 1:
        raise ValueError(f"max_length must be given: prompt tokens + max new tokens (got {max_length!r})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention decoder layers are supported; this model has {sorted(set(layer_types))}")
    config = config or QEvictConfig()
    if padded:
        return RowCache(lambda length: spec.build(model, config, length, 1), model, max_length, batch_size)
    return spec.build(model, config, max_length, batch_size)
