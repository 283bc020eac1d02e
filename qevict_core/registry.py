"""``make_cache(method, ...)``: every method the studio and the benchmarks can run, by name.

All methods take the same ``QEvictConfig``; each reads what it needs (the budget always), so a comparison at one
config is a comparison at the same ``budget_bytes``. The table below imports no cache code: each builder imports
its cache when a cache is made, so the names (the CLI's choices) cost nothing to list.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from .config import SCORER_FILES, SCORERS, QEvictConfig

POLICIES = "qevict_core.baselines.policies"


@dataclass(frozen=True)
class MethodSpec:
    build: Callable[..., Any]  # (model, config, max_length, batch_size) -> a ReportingCache
    family: str  # "reference", "qevict", "eviction" or "quantization"
    kind: str = "method"  # "method": the product's list; "ablation": runnable by name, for the benchmarks
    fixes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = field(default_factory=dict)
    text: tuple[str, str] | None = None  # (description, reference); None: the eviction policy's own
    policy_path: str | None = None  # "module.Class" under qevict_core/baselines/policies/, for eviction methods

    @property
    def fixed(self) -> Mapping[str, Any]:
        """The QEvictConfig fields this method sets itself."""
        return self.fixes() if callable(self.fixes) else self.fixes

    @property
    def policy(self) -> type | None:
        if self.policy_path is None:
            return None
        module, _, name = self.policy_path.rpartition(".")
        return getattr(importlib.import_module(f"{POLICIES}.{module}"), name)

    @property
    def description(self) -> str:
        return self.text[0] if self.text else self.policy.description

    @property
    def reference(self) -> str:
        return self.text[1] if self.text else self.policy.reference

    def lane_config(self, config: QEvictConfig) -> QEvictConfig:
        """The config a lane of this method runs with, given the form's (before any capacity fitting)."""
        return config.replace(**self.fixed)


def _qevict(name: str, same_capacity: bool = False) -> Callable[..., Any]:
    """``same_capacity``: an ablation runs with the tier capacities that QEvict gets from the same config (as the
    paper's Appendix K does), not with what its own byte needs would give (without promotion no full window
    reserves a ledger record, so Eq. 3 would hand it more full windows and the ablation would measure that too).
    An ablation of Ω keeps the same capacity in tokens: K·Ω / Ω', rounded down to whole windows. When that
    capacity does not fit the bytes (smaller windows carry more scales and scores; p-norm keeps a second table),
    the ablation runs at its own plan for the same bytes, and its K_f / K_q (in ``summary()``) say so."""
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        from .engine.budget import BudgetTooSmall, KVShape, plan_tiers
        from .engine.cache import QEvictCache
        from .engine.scorers import make_scorer

        own = METHODS[name].lane_config(config)
        cache = None
        if same_capacity and config.k_full is None:
            plan = plan_tiers(KVShape.from_model(model, batch_size, config), config, max_length,
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


def _qevict_head(name: str) -> Callable[..., Any]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        from .engine.head_cache import HeadwiseQEvictCache

        cache = HeadwiseQEvictCache(model, METHODS[name].lane_config(config), max_length, batch_size)
        cache.method = name
        return cache
    return build


def policy(name: str, path: str) -> MethodSpec:
    """An eviction method: ``path`` is "module.Class" of its policy in qevict_core/baselines/policies/."""
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        from .baselines.eviction import EvictionCache

        return EvictionCache(model, config, max_length, batch_size, METHODS[name].policy.from_config(config), name)
    return MethodSpec(build, "eviction", policy_path=path)


def _cache(module: str, cls: str, **kwargs) -> Callable[..., Any]:
    """A cache class of qevict_core/baselines/ that takes the config as it is."""
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        made = getattr(importlib.import_module(f"qevict_core.baselines.{module}"), cls)
        return made(model, config, max_length, batch_size, **kwargs)
    return build


def _scorer_fixes(scorer: str) -> Callable[[], Mapping[str, Any]]:
    def fixes() -> Mapping[str, Any]:
        # pooling reads attention masses: a scorer without them ranks unpooled
        return dict(scorer=scorer, **({} if SCORER_FILES[scorer].needs_attention else {"pool": 0}))
    return fixes


DEFAULTS = {f.name: f.default for f in fields(QEvictConfig)}
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
    "fullkv": MethodSpec(_cache("fullkv", "FullKVCache"), "reference", text=(
        "Uncompressed cache: every token in full precision (the reference).", "transformers DynamicCache semantics")),
    "fullkv_static": MethodSpec(_cache("fullkv", "StaticFullKVCache"), "reference", "ablation", text=(
        "FullKV in buffers sized for max_length, each token written in place (a server's or StaticCache's layout): "
        "the speed baseline on a GPU.", "transformers StaticCache semantics")),
    "qevict": MethodSpec(_qevict("qevict"), "qevict", text=(
        "QEvict: most windows of past tokens in 4 bits that still take part in attention and can be promoted back, "
        "the most-attended in full precision when the bytes allow, the rest evicted.",
        "arXiv 2608.05326, Alg. 1; default chosen in bench/README.md")),
    "qevict_paper": MethodSpec(_qevict("qevict_paper"), "qevict", fixes=PAPER, text=(
        "QEvict as the paper configures it: a 2-bit middle tier, Eq. 3's split (q = 0.70), prefill scores summed "
        "over every prompt query.", "arXiv 2608.05326, Sec. 5 and App. B.5")),
    "qevict_int2": MethodSpec(_qevict("qevict_int2"), "qevict", "ablation", fixes=EARLIER, text=(
        "QEvict's earlier default: INT2 windows with scales in the model's dtype, Eq. 3's split, no pooling (the "
        "reference of the default's choice).", "bench/choice.md")),
    "qevict_head": MethodSpec(_qevict_head("qevict_head"), "qevict", "ablation", fixes=HEADWISE, text=(
        "QEvict routed per KV head: each head ranks windows by its query group's attention blended with the "
        "layer's (β = 0.5), every head at the layer's capacities.",
        "arXiv 2608.05326 + Feng et al. 2024 (AdaKV); qevict_core/engine/head_cache.py")),
    "qevict_nopromo": MethodSpec(_qevict("qevict_nopromo", same_capacity=True), "qevict", "ablation",
                                 fixes=dict(promotion=False), text=(
        "QEvict one-way ablation: Full -> Quantized -> Evicted, no promotion, at QEvict's tier capacities.",
        "arXiv 2608.05326, App. K")),
    **{f"qevict_{scorer}": MethodSpec(_qevict(f"qevict_{scorer}", same_capacity=True), "qevict", "ablation",
                                      fixes=_scorer_fixes(scorer), text=(
        f"QEvict scorer ablation: windows ranked by the {scorer} score (Appendix J) at QEvict's tier capacities.",
        "arXiv 2608.05326, App. J/K"))
       for scorer in SCORERS if scorer != DEFAULTS["scorer"]},
    **{f"qevict_omega{omega}": MethodSpec(_qevict(f"qevict_omega{omega}", same_capacity=True), "qevict", "ablation",
                                          fixes=dict(omega=omega), text=(
        f"QEvict window-size ablation: Ω = {omega} (windows and routing interval) at QEvict's tier capacities in "
        "tokens.", "arXiv 2608.05326, App. K"))
       for omega in (4, 16)},
    "r1": MethodSpec(_qevict("r1"), "qevict", "ablation", fixes=dict(omega=1, q_frac=0.0, coverage=None, pool=0),
                     text=("R1: token-level eviction by cumulative attention (Ω = 1, no quantized tier).",
                           "arXiv 2608.05326, App. I.1")),
    "r2": MethodSpec(_qevict("r2"), "qevict", "ablation", fixes=dict(q_frac=0.0, coverage=None),
                     text=("R2: two-tier window eviction (Ω = 8, no quantized tier).", "arXiv 2608.05326, App. I.1")),
    "streamingllm": policy("streamingllm", "streamingllm.StreamingLLM"),
    "h2o": policy("h2o", "h2o.H2O"),
    "snapkv": policy("snapkv", "snapkv.SnapKV"),
    "adakv": policy("adakv", "adakv.AdaKV"),
    "criticalkv": policy("criticalkv", "criticalkv.CriticalKV"),
    "defensivekv": policy("defensivekv", "defensivekv.DefensiveKV"),
    "layer_defensivekv": policy("layer_defensivekv", "layer_defensivekv.LayerDefensiveKV"),
    "kivi2": MethodSpec(_cache("kivi", "KIVICache", bits=2), "quantization", text=(
        "KIVI-2: every token kept, keys per-channel and values per-token in 2 bits, a 32-token fp residual.",
        "Liu et al. 2024; jy-yuan/KIVI (G=32, R=32)")),
    "kivi4": MethodSpec(_cache("kivi", "KIVICache", bits=4), "quantization", "ablation", text=(
        "KIVI-4: as KIVI-2 with 4-bit codes.", "Liu et al. 2024; jy-yuan/KIVI")),
    "kvquant2": MethodSpec(_cache("kvquant", "KVQuantCache", bits=2), "quantization", text=(
        "KVQuant-2b (s1%): pre-RoPE per-channel keys, per-token values, 2-bit non-uniform levels, 1% sparse "
        "outliers kept exactly, the first token in full precision.",
        "Hooper et al. 2024; SqueezeAILab/KVQuant (levels and key thresholds calibrated on the prompt)")),
    "kvquant4": MethodSpec(_cache("kvquant", "KVQuantCache", bits=4), "quantization", "ablation", text=(
        "KVQuant-4b (s1%): as KVQuant-2b with 4-bit non-uniform levels.", "Hooper et al. 2024; SqueezeAILab/KVQuant")),
    "zipcache": MethodSpec(_cache("zipcache", "ZipCacheCache"), "quantization", text=(
        "ZipCache: every token kept; per head, the 40% with the highest normalised attention in 4 bits, the rest in "
        "2 bits; decoded tokens compressed 100 at a time.",
        "He et al. 2024; ThisisBillhe/ZipCache (exact saliency instead of probe tokens)")),
}

def is_reference(name: str) -> bool:
    """Whether ``name`` is FullKV, growing or static: what the studio compares every other lane with."""
    spec = METHODS.get(name)
    return spec is not None and spec.family == "reference"


def method_names(ablations: bool = False) -> list[str]:
    """The product's methods, or every runnable name with ``ablations=True`` (nothing is imported)."""
    return [name for name, spec in METHODS.items() if ablations or spec.kind == "method"]


def list_methods(ablations: bool = False) -> dict[str, str]:
    """The product's methods (FullKV, QEvict, QEvict as in the paper, the paper's baselines) -> one line each;
    ``ablations=True`` adds the ablations the benchmarks run by name."""
    return {name: METHODS[name].description for name in method_names(ablations)}


def method_info(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; methods: {sorted(method_names())}, ablations: "
                         f"{sorted(set(METHODS) - set(method_names()))}")
    return METHODS[name]
