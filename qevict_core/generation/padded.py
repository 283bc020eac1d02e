"""Left-padded batches: one cache per row, each seeing only its own row's tokens.

transformers left-pads a batch of prompts of different lengths, gives each row's real tokens the positions
0 .. n_b - 1 (``position_ids`` from the attention mask) and hides the padding with the mask. The registry caches
keep one window grid, one set of tiers and one score table per batch tensor, so in a padded row windows would
straddle the padding, sinks would be padding, and padding would be routed as context. A ``RowCache`` keeps one
cache of the method per row instead (``make_cache(..., padded=True)``): the prompt's padding is dropped before
the row's cache sees it, so every row's cache holds, routes and attends over exactly what it would alone, at
the positions it would have alone. Rows run one after another inside each layer's attention call (a padded batch
trades the batched attention for correctness); the model's projections and MLPs stay batched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..engine.cache_base import ReportingCache, ReportingLayer


class RowLayer(ReportingLayer):
    """One layer of a ``RowCache``: keeps nothing itself; ``update`` hands the new states to ``attend``, which
    passes each row's real tokens to that row's cache and attends with it."""

    accepts_padding = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def append(self, key_states, value_states):
        return key_states, value_states

    def attend_rows(self, module, query, key, value, visible, scaling: float, dropout: float):
        """query (B, Hq, L, D); key, value (B, Hkv, L, D): this forward's new tokens; ``visible`` (B, L) bool, the
        keys the newest query of each row may see (None: all). -> (B, L, Hq, D)."""
        owner, idx = self.owner, self.layer_idx
        pads = owner.padding(visible, query.shape[2]) if owner.step == 0 else [0] * len(owner.rows)
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # (B, L, Hq, D)
        for b, (row, pad) in enumerate(zip(owner.rows, pads)):
            row_keys, row_values = row.update(key[b:b + 1, :, pad:], value[b:b + 1, :, pad:], idx)
            row.layers[idx].claim(row_keys)  # drops the layer's handle on what it returned
            out[b:b + 1, pad:] = row.layers[idx].attend(module, query[b:b + 1, :, pad:], row_keys, row_values,
                                                        scaling, dropout)
        module.qevict_layer = self  # the rows' caches attached their own layers to the module
        return out

    def resident_bytes(self) -> dict[str, int]:
        return {}

    def tier_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.owner.rows:
            for tier, n in row.layers[self.layer_idx].tier_counts().items():
                counts[tier] = counts.get(tier, 0) + n
        return counts


class RowCache(ReportingCache):
    """A batch of ``batch_size`` single-row caches, ``build_row(max_length)``; what the rows keep, their moves and
    their events are theirs (``cache.rows[b]``); reports add the rows up.

    ``max_length`` counts the padding, as the batch's tensors do; a row with ``p`` padding tokens holds at most
    ``max_length - p`` tokens, so once the prompt shows the padding its cache is rebuilt at that length: its byte
    budget is then what the same prompt gets alone."""

    def __init__(self, build_row: Callable[[int], ReportingCache], model, max_length: int, batch_size: int):
        self._build_row = build_row
        self.rows = [build_row(max_length) for _ in range(batch_size)]
        layers = [RowLayer(i, self) for i in range(len(self.rows[0].layers))]
        super().__init__(layers, model, replace(self.rows[0].shape, batch=batch_size), max_length, None)
        self._sum_budgets()
        self.method, self.config = self.rows[0].method, self.rows[0].config
        self._pads: list[int] | None = None

    def _sum_budgets(self) -> None:
        budgets = [row.budget_bytes for row in self.rows]
        self.budget_bytes = None if None in budgets else sum(budgets)

    def padding(self, visible: torch.Tensor | None, length: int) -> list[int]:
        """Padding tokens per row of the prompt, read once from what the newest query of each row may see among
        the prompt (``visible`` (B, length) bool); only left padding (a hidden prefix) is possible, which is what
        ``tokenizer(..., padding_side="left")`` produces."""
        if self._pads is not None:
            return self._pads
        if visible is None:
            self._pads = [0] * len(self.rows)
            return self._pads
        pads = (~visible).long().cumprod(dim=1).sum(dim=1)  # length of each row's hidden prefix
        if int(visible.sum()) != int((length - pads).sum()):
            raise ValueError("padding must be on the left (a hidden prefix of each row): tokenize with "
                             "padding_side='left'")
        if bool((pads == length).any()):
            raise ValueError(f"rows {(pads == length).nonzero().flatten().tolist()} are all padding")
        self._pads = pads.tolist()
        self.rows = [self._build_row(self.max_length - pad) if pad else row for row, pad in zip(self.rows, self._pads)]
        self._sum_budgets()
        return self._pads

    def memory_report(self) -> dict:
        reports = [row.memory_report() for row in self.rows]
        components: dict[str, int] = {}
        for report in reports:
            for name, nbytes in report["components"].items():
                components[name] = components.get(name, 0) + nbytes
        total, fullkv = sum(components.values()), sum(r["fullkv_bytes"] for r in reports)
        budget = self.budget_bytes
        return {"total_bytes": total, "fullkv_bytes": fullkv, "ratio": total / fullkv if fullkv else 0.0,
                "budget_bytes": budget,
                "budget_ratio": budget / self.shape.fullkv_bytes(self.max_length) if budget is not None else None,
                "peak_bytes": sum(r["peak_bytes"] for r in reports), "seen": self.get_seq_length(),
                "max_length": self.max_length, "components": components, "rows": reports}

    def routed(self) -> bool:
        return any(row.routed() for row in self.rows)

    def drain_events(self) -> list:
        return [event for row in self.rows for event in row.drain_events()]

    def summary(self) -> dict:
        rows = [row.summary() for row in self.rows]
        totals = {key: sum(r[key] for r in rows) for key in ("promotions", "demotions", "evictions")
                  if all(key in r for r in rows)}
        return {**totals, "rows": rows}
