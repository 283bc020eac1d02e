"""``make_cache(method, ...)``: every method the studio and the benchmarks can run, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .cache import QEvictCache
from .cache_base import ReportingCache
from .config import QEvictConfig
from .fullkv import FullKVCache


@dataclass(frozen=True)
class MethodSpec:
    build: Callable[..., ReportingCache]
    description: str
    reference: str


def _qevict_variant(**overrides) -> Callable[..., ReportingCache]:
    def build(model, config: QEvictConfig, max_length: int, batch_size: int = 1) -> ReportingCache:
        return QEvictCache(model, config.replace(**overrides), max_length, batch_size)
    return build


METHODS: dict[str, MethodSpec] = {
    "fullkv": MethodSpec(FullKVCache, "Uncompressed cache: every token in full precision (the reference).",
                         "transformers DynamicCache semantics"),
    "qevict": MethodSpec(_qevict_variant(), "QEvict: windows routed by cumulative attention into full precision, "
                         "a recoverable INT2/INT4 tier or eviction, with promotion.", "arXiv 2608.05326, Alg. 1"),
}


def list_methods() -> dict[str, str]:
    return {name: spec.description for name, spec in METHODS.items()}


def make_cache(method: str, model, config: QEvictConfig | None = None, max_length: int | None = None,
               batch_size: int = 1) -> ReportingCache:
    """A fresh cache of ``method`` for one generation of at most ``max_length`` tokens (prompt + new tokens)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known methods: {sorted(METHODS)}")
    if max_length is None or max_length < 1:
        raise ValueError(f"max_length must be given: prompt tokens + max new tokens (got {max_length!r})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention decoder layers are supported; this model has {sorted(set(layer_types))}")
    return METHODS[method].build(model, config or QEvictConfig(), max_length, batch_size)
