"""QEvict: recoverable quantized KV-cache eviction for Hugging Face transformers (arXiv 2608.05326).

    from qevict_core import load_model, QEvictConfig, make_cache
    model, tok = load_model()
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2), max_length=prompt_len + max_new_tokens)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=..., do_sample=False)

Names are imported when first used, so ``python -m qevict_core --help`` and the config need no torch.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "QEvictConfig": "config", "Knob": "config",
    "BudgetTooSmall": "engine.budget", "KVShape": "engine.budget", "TierPlan": "engine.budget",
    "plan_tiers": "engine.budget",
    "QEvictCache": "engine.cache", "ReportingCache": "engine.cache_base",
    "DoneEvent": "events", "MemoryEvent": "events", "RoutingEvent": "events", "TokenEvent": "events",
    "event_from_dict": "events",
    "Lane": "generation.generate", "Sampling": "generation.generate", "generate_lanes": "generation.generate",
    "DEFAULT_MODEL": "models", "ModelNotFoundError": "models", "load_model": "models",
    "list_methods": "registry", "method_names": "registry",
    "make_cache": "factory", "BudgetRaised": "factory", "Fitted": "factory",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'qevict_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
