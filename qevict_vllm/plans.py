"""What each request's QEvict cache may hold, decided once per request length, the same on both sides of the
connector.

The scheduler keeps that many bytes of a request's KV blocks allocated (so vLLM's admission, its preemption and
its KV-usage metrics count QEvict's store) and hands the other blocks it has read back to the pool. The worker opens
a QEvict cache only for a request that compresses: a request whose budget holds every token (a budget of 1, or a
request too short to compress) is vLLM's own, its blocks stay with vLLM and nothing is held twice.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

from qevict_core import BudgetRaised, QEvictConfig, make_cache


@dataclass(frozen=True)
class Plan:
    length: int  # prompt + max_tokens, at most the model's length
    budget_bytes: int  # the most its QEvict cache holds: the asked share, or the least it can run with
    uncompressed: bool  # the budget holds every token: vLLM serves it alone
    raised: str | None  # why it runs above the asked share (make_cache's BudgetRaised message), if it does

    def kept_blocks(self, block_bytes: int) -> int | None:
        """vLLM blocks that stay allocated to the request: its budget in whole blocks (at least one, the request's
        first: its identity in the block table). None: it keeps all of them (vLLM's own)."""
        return None if self.uncompressed else max(1, math.ceil(self.budget_bytes / block_bytes))


class Plans:
    def __init__(self, view, config: QEvictConfig, max_model_len: int):
        self.view, self.config, self.max_model_len = view, config, max_model_len
        self.of = lru_cache(maxsize=1024)(self._plan)

    def length(self, prompt_len: int, max_tokens: int | None) -> int:
        return min(self.max_model_len, prompt_len + (max_tokens or self.max_model_len))

    def cache(self, length: int):
        """A fresh QEvict cache for ``length`` tokens, fitted by the library's rule (``make_cache``)."""
        with warnings.catch_warnings():  # the registry logs it with the request's id instead
            warnings.simplefilter("ignore", BudgetRaised)
            return make_cache("qevict", self.view, self.config, max_length=length)

    def _plan(self, length: int) -> Plan:
        cache = self.cache(length)
        return Plan(length, cache.plan.budget_bytes, cache.plan.uncompressed,
                    cache.fitted.message() if cache.fitted else None)


def block_bytes(kv_cache_config) -> int:
    """Bytes one vLLM block holds over every layer (each group's page times its layers)."""
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
