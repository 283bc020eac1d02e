"""Configuration of a compressed cache, validated on construction.

One dataclass serves QEvict, its ablations and the baselines: every method reads the fields it needs and
ignores the rest, so the studio and the benchmarks can pass one config to any method.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch

from .engine.scorers import SCORERS as SCORER_CLASSES

SCORERS = tuple(SCORER_CLASSES)  # every file in engine/scorers/ with a named Scorer
KERNEL_SETTINGS = ("auto", "triton", "cpu", "torch")
BITS = (2, 4)
SCALE_DTYPES = ("model", "float16", "bfloat16")
POOL_DIRECTIONS = ("both", "forward")
RETIRED_FIELDS = ("pool_scope",)  # fields configs once had: a stored config that names one reads without it


@dataclass(frozen=True)
class QEvictConfig:
    """Knobs of the three-tier cache. The defaults are QEvict's, chosen on development data by the rule in
    bench/choice.md: 4-bit windows with float16 scales, the low-bit tier sized first for 70% of the windows
    (coverage), forward pooling at a tenth of the score, routed per layer; ``QEvictConfig.paper()`` is the paper's
    configuration (Section 5, Appendix B.5).

    budget:       fraction of the full-precision KV bytes of ``max_length`` tokens that the cache may hold.
    budget_bytes: an absolute byte budget instead of ``budget`` (takes precedence when given).
    omega:        routing interval and window size Ω, in tokens.
    sinks:        protected attention-sink prefix, in tokens (full precision).
    recent:       protected recent region, in tokens (full precision).
    q_frac:       fraction q of the historical budget given to the quantized tier (Eq. 3).
    coverage:     None (Eq. 3's split by ``q_frac``) or a fraction κ of the windows of ``max_length``: the low-bit
                  tier is sized first, to hold κ of them (all of the historical bytes where they cannot), and only
                  the bytes left over buy full windows. Coverage before precision: where the budget is scarce a
                  window kept in low bits beats a window evicted (docs/engine.md has the measurement).
    bits:         precision of the recoverable tier (2 or 4).
    scale_dtype:  storage of the low-bit tier's scales and zero-points: "model" (the model's dtype), "float16" or
                  "bfloat16". On a float32 model a half-precision pair halves them, and they are most of a
                  window's bytes at Ω = 8 (docs/engine.md); codes are computed (in float32 at least) against the
                  stored, rounded pair, so the error bound stays half a step.
    scorer:       window ranking function (Appendix J): cumulative, decay, pnorm or keynorm.
    pool:         neighbour pooling radius r, in windows: a window ranks by the largest score within r windows of
                  it (its own first on ties), as SnapKV and AdaKV pool attention over neighbouring tokens, so a
                  kept window keeps the text that continues it. 0 = the scorer's ranking as it is (Eq. 1).
                  Attention scorers only (keynorm's scores are not masses).
    pool_weight:  γ in (0, 1], what a neighbour's score counts for in pooling: a window ranks by
                  max(s(w), γ·max of its neighbourhood). 1 ranks a neighbour just below the peak it borrows from;
                  a smaller γ lets a neighbour of a strong peak in, and one of a weak peak compete with other
                  windows. Read only when ``pool`` > 0.
    pool_direction: "both" (a window borrows from the r windows on either side) or "forward" (from the r before
                  it only: a window lends to the text that continues it).
    head_blend:   β of ``qevict_head``: each KV head ranks windows by (1 - β)·its own ranking + β·the mean of its
                  layer's heads' (1 = every head ranks alike, as QEvict's layer does; 0 = its own query group's
                  attention alone).
    head_floor:   α of ``qevict_head``: the share of the uniform capacity K_f, K_q that every head keeps before the
                  rest of the layer's slots go to the best-ranked windows of any head (AdaKV's floor; 1 = every head
                  exactly K_f and K_q).
    promotion:    allow Quantized -> Full promotion (False gives the one-way ablation).
    prefill_window: a forward of more tokens than this (the prompt) scores windows with its last
                  ``prefill_window`` queries only, an observation window as in SnapKV; 0 = every query (the
                  literal sum of Eq. 1 over the prompt). See docs/engine.md for the measurement behind the default.
    decay:        λ of the ``decay`` scorer.
    p:            exponent of the ``pnorm`` scorer.
    record_events: keep per-layer routing events on the cache for ``drain_events`` (the studio and the
                  diagnostics turn it on). Off by default: the events are Python objects outside the byte budget,
                  and building them is a visible share of a routing event on a CPU decode.
    kernels:      "auto" (the C kernel on a float32 CPU model when a C compiler builds it, else torch; on CUDA
                  torch, measured faster than Triton on an H200), "triton" (forced; on CPU under TRITON_INTERPRET=1), "cpu" (the C kernel, forced) or "torch"
                  (the quantized tier rebuilt in full precision every step).
    k_full, k_quant: tier capacities in windows per layer, set together, instead of Eq. 3's split of the budget:
                  for ablations at equal capacity (Appendix K); the plan still refuses them if the budget cannot
                  hold them, and says which bytes are missing.
    """

    budget: float = 0.2
    budget_bytes: int | None = None
    omega: int = 8
    sinks: int = 5
    recent: int = 32
    q_frac: float = 0.70
    coverage: float | None = 0.7
    bits: int = 4
    scale_dtype: str = "float16"
    scorer: str = "cumulative"
    pool: int = 1
    pool_weight: float = 0.1
    pool_direction: str = "forward"
    head_blend: float = 0.5
    head_floor: float = 0.2
    promotion: bool = True
    prefill_window: int = 32
    decay: float = 0.99
    p: float = 3.0
    record_events: bool = False
    kernels: str = "auto"
    k_full: int | None = None
    k_quant: int | None = None

    @classmethod
    def paper(cls, **changes) -> QEvictConfig:
        """The paper's configuration taken literally (Section 5, Appendix B.5): Ω = 8, 5 sinks, 32 recent tokens,
        INT2 with scales in the model's dtype, Eq. 3's split with q = 0.70, cumulative scores without pooling,
        promotion, and prefill scores summed over every prompt query (Eq. 1), where the default uses the prompt's
        last 32 queries. The paper protects 64 recent tokens on RULER and 128 on LongBench: pass ``recent=``."""
        return cls(**{**dict(omega=8, sinks=5, recent=32, bits=2, scale_dtype="model", q_frac=0.70, coverage=None,
                             scorer="cumulative", pool=0, pool_weight=1.0, pool_direction="both", promotion=True,
                             prefill_window=0), **changes})

    def __post_init__(self) -> None:
        for name in ("budget", "q_frac", "decay", "p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number (got {value!r})")
        if self.budget_bytes is not None and (isinstance(self.budget_bytes, bool)
                                              or not isinstance(self.budget_bytes, int)):
            raise ValueError(f"budget_bytes must be an integer number of bytes (got {self.budget_bytes!r})")
        if self.budget_bytes is None and not self.budget > 0:
            raise ValueError(f"budget must be a fraction > 0 of the full KV cache (got {self.budget!r})")
        if self.budget_bytes is not None and not self.budget_bytes > 0:
            raise ValueError(f"budget_bytes must be a positive number of bytes (got {self.budget_bytes!r})")
        if not (isinstance(self.omega, int) and self.omega >= 1):
            raise ValueError(f"omega must be an integer >= 1 (got {self.omega!r})")
        if not (isinstance(self.sinks, int) and self.sinks >= 0):
            raise ValueError(f"sinks must be an integer >= 0 (got {self.sinks!r})")
        if not (isinstance(self.recent, int) and self.recent >= 0):
            raise ValueError(f"recent must be an integer >= 0 (got {self.recent!r})")
        if not 0.0 <= self.q_frac <= 1.0:
            raise ValueError(f"q_frac must lie in [0, 1] (got {self.q_frac!r})")
        if self.coverage is not None and (isinstance(self.coverage, bool) or not isinstance(self.coverage, (int, float))
                                          or not 0.0 < self.coverage <= 1.0):
            raise ValueError(f"coverage must be None (split by q_frac) or a fraction in (0, 1] of the windows "
                             f"(got {self.coverage!r})")
        if not (isinstance(self.prefill_window, int) and self.prefill_window >= 0):
            raise ValueError(f"prefill_window must be an integer >= 0, 0 = every prompt query "
                             f"(got {self.prefill_window!r})")
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS} (got {self.bits!r})")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES} (got {self.scale_dtype!r})")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS} (got {self.scorer!r})")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 0:
            raise ValueError(f"pool must be an integer number of windows >= 0, 0 = no pooling (got {self.pool!r})")
        if self.pool and not SCORER_CLASSES[self.scorer].needs_attention:
            pooled = tuple(name for name, cls in SCORER_CLASSES.items() if cls.needs_attention)
            raise ValueError(f"pool needs an attention scorer {pooled}, not {self.scorer}, whose scores are not "
                             f"attention masses (got pool={self.pool!r})")
        if (isinstance(self.pool_weight, bool) or not isinstance(self.pool_weight, (int, float))
                or not 0.0 < self.pool_weight <= 1.0):
            raise ValueError(f"pool_weight must be a fraction in (0, 1], what a neighbour's score counts for in "
                             f"pooling (got {self.pool_weight!r})")
        if self.pool_direction not in POOL_DIRECTIONS:
            raise ValueError(f"pool_direction must be one of {POOL_DIRECTIONS} (got {self.pool_direction!r})")
        for name in ("head_blend", "head_floor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1] (got {value!r})")
        if self.kernels not in KERNEL_SETTINGS:
            raise ValueError(f"kernels must be one of {KERNEL_SETTINGS} (got {self.kernels!r})")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1] (got {self.decay!r})")
        if not self.p >= 1.0:
            raise ValueError(f"p must be >= 1 (got {self.p!r})")
        if (self.k_full is None) != (self.k_quant is None):
            raise ValueError(f"k_full and k_quant are set together or not at all (got k_full={self.k_full!r}, "
                             f"k_quant={self.k_quant!r})")
        for name in ("k_full", "k_quant"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer number of windows >= 0, or None (got {value!r})")

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the low-bit tier stores its scales and zero-points in, for a model of ``model_dtype``."""
        return model_dtype if self.scale_dtype == "model" else getattr(torch, self.scale_dtype)

    def replace(self, **changes) -> QEvictConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> QEvictConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(RETIRED_FIELDS))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})
