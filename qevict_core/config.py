"""Configuration of a compressed cache: one declaration of every setting, validated on construction.

Each field carries a ``Knob`` (its group, its help, its allowed values), the one declaration that the validation
here, the CLI's flags, the studio's form and the vLLM plugin's settings read. The module imports no torch and
no engine code, so the CLI can answer ``--help`` and refuse a bad flag before anything heavy loads.

Groups: "method" (what the cache is), "scorer" (a scorer's own parameters), "head" (per-head routing, read by
``qevict_head`` only), "capacity" (fixed tier sizes for ablations) and "run" (how it runs, not what it computes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .scorer_files import KINDS, scorer_files

BITS = (2, 4)
SCALE_DTYPES = ("model", "float16", "bfloat16")
KV_DTYPES = ("bfloat16", "float16", "model")
POOL_DIRECTIONS = ("both", "forward")
KERNEL_SETTINGS = ("auto", "triton", "cpu", "torch")
# A scorer is one file of engine/scorers/ named after it (tests/test_architecture.py checks the names match), read
# without importing it (scorer_files.py): the engine's modules import torch.
SCORER_FILES = scorer_files()
SCORERS = tuple(SCORER_FILES)
GROUPS = ("method", "scorer", "head", "capacity", "run")


@dataclass(frozen=True)
class Knob:
    """What one setting is and which values it takes. ``low``/``high`` bound a number (``open`` names the ends
    that are excluded: "low", "high"); ``choices`` list the values of a choice; ``optional``: None is allowed (and
    means what ``none`` says)."""

    group: str
    help: str
    kind: type
    low: float | None = None
    high: float | None = None
    open: tuple[str, ...] = ()
    choices: tuple | None = None
    optional: bool = False
    none: str = ""

    def allowed(self) -> str:
        """The allowed values in words, for errors and help."""
        if self.choices is not None:
            text = f"one of {self.choices}"
        elif self.kind is bool:
            text = "True or False"
        else:
            noun = "an integer" if self.kind is int else "a number"
            if self.low is not None and self.high is not None:
                text = (f"{noun} in {'(' if 'low' in self.open else '['}{_num(self.low)}, {_num(self.high)}"
                        f"{')' if 'high' in self.open else ']'}")
            elif self.low is not None:
                text = f"{noun} {'>' if 'low' in self.open else '>='} {_num(self.low)}"
            else:
                text = noun
        return f"None ({self.none}) or {text}" if self.optional else text

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        ok = _fits(self, value)
        if not ok:
            raise ValueError(f"{name} must be {self.allowed()} (got {value!r})")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _fits(knob: Knob, value: Any) -> bool:
    if knob.choices is not None:
        return any(value == c and type(value) is type(c) for c in knob.choices)
    if knob.kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if knob.kind is int and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    if knob.low is not None and (value <= knob.low if "low" in knob.open else value < knob.low):
        return False
    return knob.high is None or (value < knob.high if "high" in knob.open else value <= knob.high)


def knob(default: Any, group: str, help: str, kind: type, **rules: Any) -> Any:
    return field(default=default, metadata={"knob": Knob(group, help, kind, **rules)})


def _scorer_fields() -> dict[str, tuple[str, Any]]:
    """Each scorer's own settings (engine/scorers/<name>.py: PARAMETERS) as QEvictConfig fields of group "scorer":
    name -> (annotation, field). The CLI's flags, the vLLM plugin's settings and ``method+field=value`` read them as
    they read every other field."""
    out = {}
    for scorer in SCORER_FILES.values():
        for name, spec in scorer.parameters.items():
            rules = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()
                     if k not in ("default", "help", "kind")}
            out[name] = (spec["kind"], knob(spec["default"], "scorer", f"{spec['help']} ({scorer.name} scorer)",
                                            KINDS[spec["kind"]], **rules))
    return out


SCORER_FIELDS = _scorer_fields()


@dataclass(frozen=True)
class QEvictConfig:
    """Knobs of the three-tier cache. The defaults are QEvict's, chosen on development data by the rule in
    bench/choice.md: 4-bit windows with float16 scales, the low-bit tier sized first for 70% of the windows
    (coverage), forward pooling at a tenth of the score, routed per layer; ``QEvictConfig.paper()`` is the paper's
    configuration (Section 5, Appendix B.5). ``QEvictConfig.knobs()`` lists every field with its help."""

    budget: float = knob(0.2, "method", "fraction of the full-precision KV bytes of max_length tokens that the cache "
                         "may hold; 1 holds every token", float, low=0, high=1, open=("low",))
    budget_bytes: int | None = knob(None, "method", "an absolute byte budget instead of budget (takes precedence)",
                                    int, low=0, open=("low",), optional=True, none="use budget")
    omega: int = knob(8, "method", "routing interval and window size Ω, in tokens", int, low=1)
    sinks: int = knob(5, "method", "protected attention-sink prefix, in tokens (full precision)", int, low=0)
    recent: int = knob(32, "method", "protected recent region, in tokens (full precision)", int, low=0)
    q_frac: float = knob(0.70, "method", "fraction q of the historical bytes given to the quantized tier (Eq. 3); "
                         "read when coverage is None", float, low=0, high=1)
    coverage: float | None = knob(0.7, "method", "size the low-bit tier first to hold this fraction κ of the windows "
                                  "of max_length (the bytes left buy full windows): coverage before precision, where "
                                  "the budget is scarce a window kept in low bits beats one evicted", float, low=0,
                                  high=1, open=("low",), optional=True, none="split by q_frac")
    bits: int = knob(4, "method", "precision of the recoverable tier", int, choices=BITS)
    kv_dtype: str = knob("bfloat16", "method", "storage of every full-precision key and value, FullKV's included, "
                         "whatever the model computes in: 16 bits, as deployed, so budgets are shares of a 16-bit "
                         "cache; model = the model's own dtype (float32 on a CPU: not a deployed footing)", str,
                         choices=KV_DTYPES)
    scale_dtype: str = knob("float16", "method", "storage of the low-bit tier's scales and zero-points (model: "
                            "kv_dtype); codes are computed against the stored, rounded pair, so the error bound stays "
                            "half a step", str, choices=SCALE_DTYPES)
    scorer: str = knob("cumulative", "method", "window ranking function (Appendix J)", str, choices=SCORERS)
    pool: int = knob(1, "method", "neighbour pooling radius r, in windows: a window ranks by the largest score "
                     "within r windows of it (its own first on ties), so a kept window keeps the text that "
                     "continues it; 0 = no pooling (Eq. 1 as it is)", int, low=0)
    pool_weight: float = knob(0.1, "method", "γ, what a neighbour's score counts for in pooling: a window ranks by "
                              "max(s(w), γ·max of its neighbourhood)", float, low=0, high=1, open=("low",))
    pool_direction: str = knob("forward", "method", "borrow from the r windows on either side (both), or from the "
                               "r before it only (forward: a window lends to the text that continues it)", str,
                               choices=POOL_DIRECTIONS)
    promotion: bool = knob(True, "method", "allow Quantized -> Full promotion (False: the one-way ablation)", bool)
    prefill_window: int = knob(32, "method", "a prompt scores windows with its last prefill_window queries only (an "
                               "observation window, as SnapKV); 0 = every prompt query (Eq. 1 literally)", int, low=0)
    # Each scorer's own settings, declared in its file: fields here like any other (see SCORER_FIELDS)
    if SCORER_FIELDS.keys() & vars().keys():
        raise TypeError(f"a scorer declares a setting QEvictConfig already has: {SCORER_FIELDS.keys() & vars().keys()}")
    __annotations__.update({name: kind for name, (kind, _) in SCORER_FIELDS.items()})
    vars().update({name: spec for name, (_, spec) in SCORER_FIELDS.items()})
    head_blend: float = knob(0.5, "head", "β of qevict_head: each KV head ranks windows by (1 - β)·its own ranking "
                             "+ β·the mean of its layer's heads'", float, low=0, high=1)
    head_floor: float = knob(0.2, "head", "α of qevict_head: the share of the uniform capacities K_f, K_q every "
                             "head keeps before the rest goes to the best-ranked windows of any head", float, low=0,
                             high=1)
    k_full: int | None = knob(None, "capacity", "full windows per layer (with k_quant), instead of Eq. 3's split: "
                              "ablations at equal capacity", int, low=0, optional=True, none="from the budget")
    k_quant: int | None = knob(None, "capacity", "quantized windows per layer (with k_full)", int, low=0,
                               optional=True, none="from the budget")
    record_events: bool = knob(False, "run", "keep per-layer routing events for drain_events (the studio and the "
                               "diagnostics): Python objects outside the byte budget", bool)
    kernels: str = knob("auto", "run", "who reads the low-bit tier: auto (the C kernel on a float32 CPU model when a "
                        "compiler builds it, else torch), triton (forced; on a CPU under TRITON_INTERPRET=1), cpu "
                        "(the C kernel, forced) or torch (the tier rebuilt in full precision every step)", str,
                        choices=KERNEL_SETTINGS)

    @classmethod
    def paper(cls, **changes) -> QEvictConfig:
        """The paper's configuration taken literally (Section 5, Appendix B.5): Ω = 8, 5 sinks, 32 recent tokens,
        INT2 with scales in the model's dtype, Eq. 3's split with q = 0.70, cumulative scores without pooling,
        promotion, and prefill scores summed over every prompt query (Eq. 1), where the default uses the prompt's
        last 32 queries. The paper protects 64 recent tokens on RULER and 128 on LongBench: pass ``recent=``."""
        return cls(**{**dict(omega=8, sinks=5, recent=32, bits=2, scale_dtype="model", q_frac=0.70, coverage=None,
                             scorer="cumulative", pool=0, pool_weight=1.0, pool_direction="both", promotion=True,
                             prefill_window=0), **changes})

    @classmethod
    def knobs(cls, group: str | None = None) -> dict[str, Knob]:
        """Every field's declaration (of ``group`` only, when given), in the order of the fields."""
        return {f.name: f.metadata["knob"] for f in fields(cls) if group in (None, f.metadata["knob"].group)}

    def __post_init__(self) -> None:
        for name, spec in self.knobs().items():
            spec.check(name, getattr(self, name))
        if (self.k_full is None) != (self.k_quant is None):
            raise ValueError(f"k_full and k_quant are set together or not at all (got k_full={self.k_full!r}, "
                             f"k_quant={self.k_quant!r})")
        if self.pool and not SCORER_FILES[self.scorer].needs_attention:
            pooled = tuple(name for name, scorer in SCORER_FILES.items() if scorer.needs_attention)
            raise ValueError(f"pool needs an attention scorer {pooled}, not {self.scorer}, whose scores are not "
                             f"attention masses (got pool={self.pool!r})")

    def storage_dtype(self, model_dtype):
        """The dtype every full-precision key and value is stored in, for a model computing in ``model_dtype``."""
        import torch

        return model_dtype if self.kv_dtype == "model" else getattr(torch, self.kv_dtype)

    def param_dtype(self, kv_dtype):
        """The dtype the low-bit tier stores its scales and zero-points in, for a cache storing ``kv_dtype``."""
        import torch

        return kv_dtype if self.scale_dtype == "model" else getattr(torch, self.scale_dtype)

    def replace(self, **changes) -> QEvictConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> QEvictConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)
