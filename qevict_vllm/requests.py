"""One QEvict cache per running request, shared by every layer's attention in the worker.

The worker side of the connector (connector.py) opens a request's cache when the scheduler first schedules it,
tells it which forwards are chunks of its prompt, and closes it when the request finishes or is preempted
(vLLM recomputes a preempted request from its first token). Attention finds a request by the first block of its
block table, which is the request's own while it runs (prefix caching is off).
"""

from __future__ import annotations

from dataclasses import dataclass

import logging
import warnings

from qevict_core import BudgetRaised, QEvictConfig, make_cache

from .model_view import ModelView


LOG = logging.getLogger("qevict_vllm")


@dataclass
class Running:
    req_id: str
    cache: object  # a QEvictCache for prompt + max_tokens tokens
    prompt_len: int
    raised_to: int | None = None  # bytes it runs at when the budget could not hold its protected tokens


class Requests:
    def __init__(self, view: ModelView, config: QEvictConfig, max_model_len: int):
        self.view, self.config, self.max_model_len = view, config, max_model_len
        self.by_block: dict[int, Running] = {}
        self.by_id: dict[str, int] = {}
        self.retain = 0  # finished requests kept for inspection (tests, bench): their caches stay in memory
        self.finished: dict[str, Running] = {}

    def open(self, req_id: str, first_block: int, prompt_len: int, max_tokens: int | None) -> None:
        self.close(req_id)
        length = min(self.max_model_len, prompt_len + (max_tokens or self.max_model_len))
        with warnings.catch_warnings():  # logged with the request's id instead
            warnings.simplefilter("ignore", BudgetRaised)
            cache = make_cache("qevict", self.view, self.config, max_length=length)
        raised = cache.fitted.needed_bytes if cache.fitted else None
        if cache.fitted:  # a short request: its sinks and recent tokens alone exceed the share
            LOG.warning("request %s (%d tokens): %s", req_id, length, cache.fitted.message())
        self.by_block[first_block] = Running(req_id, cache, prompt_len, raised)
        self.by_id[req_id] = first_block

    def close(self, req_id: str) -> None:
        block = self.by_id.pop(req_id, None)
        if block is not None:
            running = self.by_block.pop(block, None)
            if self.retain and running is not None:
                self.finished[req_id] = running
                while len(self.finished) > self.retain:
                    self.finished.pop(next(iter(self.finished)))

    def schedule(self, req_id: str, computed: int, scheduled: int) -> None:
        """The next forward reads ``scheduled`` tokens of ``req_id`` after ``computed``: a chunk of its prompt
        before the last one is staged (the engine routes the prompt once, at its last chunk)."""
        running = self.by_block.get(self.by_id.get(req_id, -1))
        if running is None:
            return
        if computed < running.prompt_len and (computed > 0 or computed + scheduled < running.prompt_len):
            running.cache.read_prompt_chunk(more_to_come=computed + scheduled < running.prompt_len)

    def report(self) -> dict[str, dict]:
        """Per running request: its QEvict cache's measured bytes (``memory_report``: the low-bit store, the full
        windows, sinks, recent tokens, scores) and its moves between tiers."""
        return {r.req_id: {**r.cache.memory_report(), **r.cache.summary(), "raised_to": r.raised_to}
                for r in (*self.finished.values(), *self.by_block.values())}

    def find(self, first_block: int) -> Running:
        running = self.by_block.get(first_block)
        if running is None:
            raise RuntimeError(f"no QEvict cache holds the request whose first KV block is {first_block}: the "
                               "connector did not see it scheduled")
        return running
