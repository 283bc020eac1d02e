"""``make_cache(method, ...)``: every method the studio and the benchmarks can run, by name.

All methods take the same ``QEvictConfig``; each reads what it needs (the budget always), so a comparison at one
config is a comparison at the same ``budget_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .engine.budget import BudgetTooSmall, KVShape, plan_tiers
from .engine.cache import QEvictCache
from .engine.cache_base import ReportingCache
from .config import QEvictConfig
from .baselines.eviction import EvictionCache
from .baselines.fullkv import FullKVCache
from .engine.head_cache import HeadwiseQEvictCache
from .baselines.kivi import KIVICache
from .baselines.kvquant import KVQuantCache
from .generation.padded import RowCache
from .baselines.policies.adakv import AdaKV
from .baselines.policies.base import Policy
from .baselines.policies.criticalkv import CriticalKV
from .baselines.policies.defensivekv import DefensiveKV
from .baselines.policies.h2o import H2O
from .baselines.policies.layer_defensivekv import LayerDefensiveKV
from .baselines.policies.snapkv import SnapKV
from .baselines.policies.streamingllm import StreamingLLM
from .engine.scorers import SCORERS, make_scorer
from .baselines.zipcache import ZipCacheCache


@dataclass(frozen=True)
class MethodSpec:
    build: Callable[..., ReportingCache]
    description: str
    reference: str
    family: str  # "reference", "qevict", "eviction" or "quantization"
    kind: str = "method"  # "method": the product's list; "ablation": runnable by name, for the benchmarks
    fixed: Mapping[str, Any] = field(default_factory=dict)  # the QEvictConfig fields this method sets itself
    policy: type | None = None  # the eviction policy an "eviction" method runs

    def lane_config(self, config: QEvictConfig) -> QEvictConfig:
        """The config a lane of this method runs with, given the form's (before any capacity fitting)."""
        return config.replace(**self.fixed)


def _qevict(name: str, same_capacity: bool = False) -> Callable[..., ReportingCache]:
    """``same_capacity``: an ablation runs with the tier capacities that QEvict gets from the same config (as the
    paper's Appendix K does), not with what its own byte needs would give (without promotion no full window
    reserves a ledger record, so Eq. 3 would hand it more full windows and the ablation would measure that too).
    An ablation of Ω keeps the same capacity in tokens: K·Ω / Ω', rounded down to whole windows. When that
    capacity does not fit the bytes (smaller windows carry more scales and scores; p-norm keeps a second table),
    the ablation runs at its own plan for the same bytes, and its K_f / K_q (in ``summary()``) say so."""
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        own = METHODS[name].lane_config(config)
        cache = None
        if same_capacity and config.k_full is None:
            plan = plan_tiers(KVShape.from_model(model, batch_size), config, max_length,
                              interval_table=make_scorer(config).keeps_interval)
            if not plan.uncompressed:
                fixed = own.replace(k_full=plan.k_full * config.omega // own.omega,
                                    k_quant=plan.k_quant * config.omega // own.omega)
                try:
                    cache = QEvictCache(model, fixed, max_length, batch_size)
                except BudgetTooSmall:
                    pass  # its own plan, below
        if cache is None:
            cache = QEvictCache(model, own, max_length, batch_size)
        cache.method = name
        return cache
    return build


def _qevict_head(name: str) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        cache = HeadwiseQEvictCache(model, METHODS[name].lane_config(config), max_length, batch_size)
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
    return MethodSpec(_evict(name, make_policy), cls.description, cls.reference, "eviction", policy=cls)


# The paper's QEvict, taken literally: every field QEvictConfig.paper() sets that the form does not own (the form
# owns the budget, Ω, the sinks and the recent region, which the paper's own experiments vary too).
PAPER = {k: v for k, v in QEvictConfig.paper().to_dict().items()
         if k in ("bits", "scale_dtype", "q_frac", "coverage", "scorer", "pool", "pool_weight", "pool_direction",
                  "promotion", "prefill_window")}
# QEvict's default before the current one was chosen (bench/README.md): INT2 in the model's dtype, Eq. 3, no pooling.
EARLIER = dict(bits=2, scale_dtype="model", coverage=None, pool=0, pool_weight=1.0, pool_direction="both")
# Per-head routing as measured: the default's pooling, every head at the layer's capacities.
HEADWISE = dict(pool=1, pool_direction="forward", pool_weight=0.1, head_floor=1.0)

METHODS: dict[str, MethodSpec] = {
    "fullkv": MethodSpec(FullKVCache, "Uncompressed cache: every token in full precision (the reference).",
                         "transformers DynamicCache semantics", "reference"),
    "qevict": MethodSpec(_qevict("qevict"), "QEvict: most windows of past tokens in 4 bits that still take part in "
                         "attention and can be promoted back, the most-attended in full precision when the bytes "
                         "allow, the rest evicted.",
                         "arXiv 2608.05326, Alg. 1; default chosen in bench/README.md", "qevict"),
    "qevict_paper": MethodSpec(_qevict("qevict_paper"), "QEvict as the paper configures it: a 2-bit middle tier, "
                               "Eq. 3's split (q = 0.70), prefill scores summed over every prompt query.",
                               "arXiv 2608.05326, Sec. 5 and App. B.5", "qevict", fixed=PAPER),
    "qevict_int2": MethodSpec(_qevict("qevict_int2"), "QEvict's earlier default: INT2 windows with scales in the "
                              "model's dtype, Eq. 3's split, no pooling (the reference of the default's choice).",
                              "bench/choice.md", "qevict", "ablation", fixed=EARLIER),
    "qevict_head": MethodSpec(_qevict_head("qevict_head"), "QEvict routed per KV head: each head ranks windows by "
                              "its query group's attention blended with the layer's (β = 0.5), every head at the "
                              "layer's capacities.", "arXiv 2608.05326 + Feng et al. 2024 (AdaKV); "
                              "qevict_core/engine/head_cache.py", "qevict", "ablation", fixed=HEADWISE),
    "qevict_nopromo": MethodSpec(_qevict("qevict_nopromo", same_capacity=True),
                                 "QEvict one-way ablation: Full -> Quantized -> Evicted, no promotion, at QEvict's "
                                 "tier capacities.", "arXiv 2608.05326, App. K", "qevict", "ablation",
                                 fixed=dict(promotion=False)),
    **{f"qevict_{scorer}": MethodSpec(_qevict(f"qevict_{scorer}", same_capacity=True),
                                      f"QEvict scorer ablation: windows ranked by the {scorer} score (Appendix J) "
                                      "at QEvict's tier capacities.", "arXiv 2608.05326, App. J/K", "qevict",
                                      "ablation", fixed=dict(scorer=scorer, **({} if cls.needs_attention
                                                                               else {"pool": 0})))
       for scorer, cls in SCORERS.items() if scorer != QEvictConfig().scorer},
    **{f"qevict_omega{omega}": MethodSpec(_qevict(f"qevict_omega{omega}", same_capacity=True),
                                          f"QEvict window-size ablation: Ω = {omega} (windows and routing interval) "
                                          "at QEvict's tier capacities in tokens.", "arXiv 2608.05326, App. K",
                                          "qevict", "ablation", fixed=dict(omega=omega))
       for omega in (4, 16)},
    "r1": MethodSpec(_qevict("r1"), "R1: token-level eviction by cumulative attention (Ω = 1, no quantized tier).",
                     "arXiv 2608.05326, App. I.1", "qevict", "ablation",
                     fixed=dict(omega=1, q_frac=0.0, coverage=None, pool=0)),
    "r2": MethodSpec(_qevict("r2"), "R2: two-tier window eviction (Ω = 8, no quantized tier).",
                     "arXiv 2608.05326, App. I.1", "qevict", "ablation", fixed=dict(q_frac=0.0, coverage=None)),
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
                        "quantization", "ablation"),
    "kvquant2": MethodSpec(_kvquant(2), "KVQuant-2b (s1%): pre-RoPE per-channel keys, per-token values, 2-bit "
                           "non-uniform levels, 1% sparse outliers kept exactly, the first token in full precision.",
                           "Hooper et al. 2024; SqueezeAILab/KVQuant (levels and key thresholds calibrated on the "
                           "prompt)", "quantization"),
    "kvquant4": MethodSpec(_kvquant(4), "KVQuant-4b (s1%): as KVQuant-2b with 4-bit non-uniform levels.",
                           "Hooper et al. 2024; SqueezeAILab/KVQuant", "quantization", "ablation"),
    "zipcache": MethodSpec(ZipCacheCache, "ZipCache: every token kept; per head, the 40% with the highest "
                           "normalised attention in 4 bits, the rest in 2 bits; decoded tokens compressed 100 at a time.",
                           "He et al. 2024; ThisisBillhe/ZipCache (exact saliency instead of probe tokens)",
                           "quantization"),
}

# Removed methods, for sessions stored or exported before they went: name -> (the method that runs it now, the
# config fields it set on top of that method's). Their committed result rows keep their names.
RETIRED: dict[str, tuple[str, dict[str, Any]]] = {
    "qevict_int4": ("qevict", dict(bits=4, scale_dtype="model", coverage=None, pool=0, pool_weight=1.0,
                                   pool_direction="both")),
    "qevict_int4_f16scale": ("qevict", dict(bits=4, scale_dtype="float16", coverage=None, pool=0, pool_weight=1.0,
                                            pool_direction="both")),
    "qevict_cover": ("qevict", dict(bits=4, scale_dtype="float16", coverage=0.7, pool=0, pool_weight=1.0,
                                    pool_direction="both")),
    "qevict_pool": ("qevict", dict(pool=1, pool_weight=1.0, pool_direction="both")),
    "qevict_head_pool": ("qevict_head", dict(pool=1, pool_weight=1.0, pool_direction="both", head_floor=0.2)),
    "qevict_head_nopool": ("qevict_head", dict(pool=0, head_floor=0.2)),
    "qevict_head_own": ("qevict_head", dict(pool=0, head_floor=0.2, head_blend=0.0)),
}


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """(method, config changes) for a method named by a stored session: a retired name maps to what runs it now."""
    if name in METHODS:
        return name, {}
    if name in RETIRED:
        return RETIRED[name]
    method_info(name)  # raises, naming the allowed methods
    raise AssertionError(name)


def stored_lane_config(name: str, config: QEvictConfig) -> QEvictConfig:
    """The config a lane of a session stored without per-lane configs ran with: the form's, with its method's
    fields (a retired method's on top of those of the method that replaced it)."""
    method, changes = resolve(name)
    return METHODS[method].lane_config(config).replace(**changes)


def list_methods(ablations: bool = False) -> dict[str, str]:
    """The product's methods (FullKV, QEvict, QEvict as in the paper, the paper's baselines) -> one line each;
    ``ablations=True`` adds the ablations the benchmarks run by name."""
    return {name: spec.description for name, spec in METHODS.items() if ablations or spec.kind == "method"}


def method_info(name: str) -> MethodSpec:
    if name not in METHODS:
        retired = (f"; {name!r} was removed (it is {RETIRED[name][0]} with {RETIRED[name][1]})"
                   if name in RETIRED else "")
        raise ValueError(f"unknown method {name!r}{retired}; methods: {sorted(list_methods())}, ablations: "
                         f"{sorted(set(METHODS) - set(list_methods()))}")
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
