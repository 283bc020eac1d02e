"""One forward of a model with a cache, whatever the installed transformers calls the cache's keyword.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works there, with a deprecation
warning); 5.20, the last release for Python 3.10 (a ZeroGPU Space's), and the one vLLM pins know only
``past_key_values``. The keyword is read once per model class from its ``forward``.
"""

from __future__ import annotations

import inspect
from functools import lru_cache


@lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def call(model, input_ids, cache, **kwargs):
    """``model(input_ids=..., <cache keyword>=cache, **kwargs)``."""
    return model(input_ids=input_ids, **{cache_keyword(type(model)): cache}, **kwargs)
