"""One QEvict cache per running request, shared by every layer's attention in the worker.

The worker side of the connector (connector.py) opens a request's cache when the scheduler first schedules it,
tells it which forwards are chunks of its prompt, and closes it when the request finishes or is preempted
(vLLM recomputes a preempted request from its first token). A request whose budget holds every token gets no
QEvict cache (plans.py): vLLM's own attention serves it. Attention finds a request by the first block of its block
table, which is the request's own while it runs (prefix caching is off).
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

from qevict_core import QEvictConfig

from .model_view import ModelView
from .plans import Plans


LOG = logging.getLogger("qevict_vllm")


@dataclass
class Running:
    req_id: str
    cache: object | None  # a QEvictCache for prompt + max_tokens tokens; None: vLLM's own (it would not compress)
    prompt_len: int
    raised_to: int | None = None  # bytes it runs at when the budget could not hold its protected tokens


class Requests:
    def __init__(self, view: ModelView, config: QEvictConfig, max_model_len: int):
        self.view = view
        self.plans = Plans(view, config, max_model_len)
        self.by_block: dict[int, Running] = {}
        self.by_id: dict[str, int] = {}
        self.retain = 0  # finished requests kept for inspection (tests, bench): their caches stay in memory
        self.finished: dict[str, Running] = {}

    def open(self, req_id: str, first_block: int, prompt_len: int, max_tokens: int | None) -> None:
        self.close(req_id)
        plan = self.plans.of(self.plans.length(prompt_len, max_tokens))
        if plan.raised:  # a short request: its sinks and recent tokens alone exceed the share
            LOG.warning("request %s (%d tokens): %s", req_id, plan.length, plan.raised)
        cache = None if plan.uncompressed else self.plans.cache(plan.length)
        self.by_block[first_block] = Running(req_id, cache, prompt_len, plan.budget_bytes if plan.raised else None)
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
        if running is None or running.cache is None:
            return
        if computed < running.prompt_len and (computed > 0 or computed + scheduled < running.prompt_len):
            running.cache.read_prompt_chunk(more_to_come=computed + scheduled < running.prompt_len)

    def report(self) -> dict[str, dict]:
        """Per running request: its QEvict cache's measured bytes (``memory_report``: the low-bit store, the full
        windows, sinks, recent tokens, scores) and its moves between tiers; a request vLLM serves alone (its
        budget holds every token) holds nothing here."""
        return {r.req_id: ({**r.cache.memory_report(), **r.cache.summary(), "raised_to": r.raised_to}
                           if r.cache is not None else {"total_bytes": 0, "uncompressed": True})
                for r in (*self.finished.values(), *self.by_block.values())}

    def find(self, first_block: int) -> Running:
        running = self.by_block.get(first_block)
        if running is None:
            raise RuntimeError(f"no QEvict cache holds the request whose first KV block is {first_block}: the "
                               "connector did not see it scheduled")
        return running
