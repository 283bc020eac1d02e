"""``make_cache``: a fresh cache of any registered method, fitted to the budget, for ``model.generate``.

One rule decides what happens when a budget cannot hold what a method must always keep (on a short sequence,
QEvict's sinks, recent region and pending tokens; SnapKV's observation window): the cache runs at the least
budget it can, says so in a ``BudgetRaised`` warning with the ratio it runs at, and keeps that in
``cache.fitted``. The studio's lanes and the vLLM plugin's requests go through this function too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

from .config import QEvictConfig
from .registry import method_info


class BudgetRaised(UserWarning):
    """A cache runs above the asked budget: the least it can run with on this sequence (``cache.fitted``)."""


@dataclass(frozen=True)
class Fitted:
    """What ``make_cache`` did with a budget too small for the sequence: ``needed_bytes`` is what the cache runs
    at, ``fullkv_bytes`` FullKV's bytes for ``max_length`` tokens, ``reason`` what takes that much."""

    method: str
    asked: float | None  # the asked share of FullKV's bytes (None when an absolute budget_bytes was asked)
    needed_bytes: int
    fullkv_bytes: int
    reason: str

    @property
    def ratio(self) -> float:
        return self.needed_bytes / self.fullkv_bytes

    def message(self) -> str:
        asked = f"{self.asked:.1%}" if self.asked is not None else "the asked bytes"
        return (f"{self.method} runs at {self.ratio:.1%} of FullKV's bytes, not {asked}: {self.reason}. That is "
                "the least it can run with on a sequence this short.")


def context_length(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    length = getattr(cfg, "max_position_embeddings", None)
    if not length:
        raise ValueError(f"{type(model).__name__} declares no context length (max_position_embeddings): give "
                         "max_length, the prompt's tokens plus the new tokens")
    return int(length)


def make_cache(method: str, model, config: QEvictConfig | None = None, max_length: int | None = None,
               batch_size: int = 1, padded: bool = False, strict: bool = False):
    """A fresh cache of ``method`` for one generation of at most ``max_length`` tokens (prompt + new tokens).

    ``config``: the knobs (budget and the rest; default ``QEvictConfig()``). ``max_length``: the most tokens the
    cache will see; the budget is a share of FullKV's bytes for that many. Default: the model's context length
    (``max_position_embeddings``), so the budget is a share of a full context's bytes, as a server sizes memory
    per sequence. Either way the cache's tensors are sized to what is live: it grows with the sequence, up to the
    budget.
    ``padded``: the batch may be left-padded (prompts of different lengths): one cache per row, each seeing only
    its row's tokens, so every row generates what its prompt generates alone (generation/padded.py).
    ``strict``: a budget too small for what the method must always keep raises ``BudgetTooSmall`` instead of
    running at the least it can (``BudgetRaised`` warning, ``cache.fitted``).

    Pass it to ``model.generate(..., past_key_values=cache)`` (or ``cache=``). The model's attention
    implementation is wrapped, not replaced: a call that is not this cache's runs the implementation the model had.
    """
    spec = method_info(method)
    if max_length is None:
        max_length = context_length(model)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a whole number of tokens >= 1: prompt tokens + max new tokens "
                         f"(got {max_length!r})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1 (got {batch_size!r})")
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention decoder layers are supported; this model has {sorted(set(layer_types))}")
    config = config or QEvictConfig()

    def build(length: int, rows: int):
        return fit(method, lambda cfg: spec.build(model, cfg, length, rows), config, strict)

    if padded:
        from .generation.padded import RowCache

        return RowCache(lambda length: build(length, 1), model, max_length, batch_size)
    return build(max_length, batch_size)


def fit(method: str, build: Callable[[QEvictConfig], object], config: QEvictConfig, strict: bool = False):
    """``build(config)``, or, when its budget cannot hold what the method must always keep, ``build`` at the least
    budget that runs, with a ``BudgetRaised`` warning and ``cache.fitted`` saying so."""
    from .engine.budget import BudgetTooSmall

    try:
        return build(config)
    except BudgetTooSmall as err:
        if strict or not err.fittable:
            raise
        cache = build(config.replace(budget_bytes=err.needed_bytes))
        cache.fitted = Fitted(method, config.budget if config.budget_bytes is None else None, err.needed_bytes,
                              cache.shape.fullkv_bytes(cache.max_length), err.reason)
        warnings.warn(cache.fitted.message(), BudgetRaised, stacklevel=4)  # fit < build < make_cache < the caller
        return cache
