"""QEvict: recoverable quantized KV-cache eviction for Hugging Face transformers (arXiv 2608.05326).

    from qevict_core import load_model, QEvictConfig, make_cache
    model, tok = load_model()
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2), max_length=prompt_len + max_new_tokens)
    out = model.generate(input_ids, cache=cache, max_new_tokens=..., do_sample=False)
"""

from . import moved
from .config import QEvictConfig
from .engine.budget import BudgetTooSmall, KVShape, TierPlan, plan_tiers
from .engine.cache import QEvictCache
from .engine.cache_base import ReportingCache
from .events import DoneEvent, MemoryEvent, RoutingEvent, TokenEvent, event_from_dict
from .generation.generate import Lane, Sampling, generate_lanes
from .models import DEFAULT_MODEL, ModelNotFoundError, load_model
from .registry import list_methods, make_cache

moved.install()

__all__ = [
    "BudgetTooSmall", "DEFAULT_MODEL", "DoneEvent", "KVShape", "Lane", "MemoryEvent", "ModelNotFoundError",
    "QEvictCache", "QEvictConfig", "ReportingCache", "RoutingEvent", "Sampling", "TierPlan", "TokenEvent",
    "event_from_dict", "generate_lanes", "list_methods", "load_model", "make_cache", "plan_tiers",
]
