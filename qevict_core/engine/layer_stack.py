"""Every layer's tiers as rows of one storage, so that a routing event moves the whole model's windows with one set
of operators instead of one set per layer (issue 44, item 3).

The layers of a row cache hold tiers of the same sizes and age the same windows out of their recent regions, and a
decode step's routing event waits for the end of the forward (``QEvictCache.defer_move``). At the end of a forward
that routed, the cache copies the layers' tiers, once, into a ``StackedLayer``: a layer of L·B rows whose tensors
are the storage, layer l's being rows [l·B, (l+1)·B) (views, each contiguous, so the kernels read them as before;
the bytes are counted once, by the layers). A decode step's event is then one move of the stack (row_move.py,
as for batch rows: rows of different layers are as independent as batch rows, and one decision ranks them all as
``decide_rows`` does), after which every layer takes its rows again (the same storage while the tiers keep their
sizes). Tokens, moves and bytes are those of the layer-by-layer move; only the count of operators changes. If a
layer's tensors stop being its rows (a continuation read at once grew its buffer), that forward moves layer by
layer and the stack is built again at its end.
"""

from __future__ import annotations

import torch

from .fp_region import FullPrecision
from .ledger import TENSORS, WindowLedger
from .qevict_layer import QEvictLayer
from .row_move import settle


class StackedLayer(QEvictLayer):
    """``layers`` (QEvictLayer, every one of a row cache, in order) as one layer of L·B rows."""

    stacks_as_rows = False
    # this forward's tables every layer reads alike (``step_table``), dropped by the cache at the forward's end
    step_tables: dict | None = None

    def __init__(self, layers: list[QEvictLayer]):
        first = layers[0]
        super().__init__(None, first.owner)
        self.layers = layers
        self.fp = FullPrecision.join_rows([layer.fp for layer in layers])
        self.recent_origin = None if first.recent_origin is None else torch.cat([x.recent_origin for x in layers])
        self.full_ids = torch.cat([layer.full_ids for layer in layers])
        self.dormant_valid = torch.cat([layer.dormant_valid for layer in layers])
        self.quant = WindowLedger.join_rows([layer.quant for layer in layers])
        self.dormant = None if first.dormant is None else WindowLedger.join_rows([x.dormant for x in layers])
        self.scores = torch.cat([layer.scores for layer in layers])
        self.interval = None if first.interval is None else torch.cat([layer.interval for layer in layers])
        self.stage = None
        self.is_initialized = True
        self._follow(first)
        for index, layer in enumerate(layers):
            layer.take_rows(self, index)

    @staticmethod
    def can_hold(layers: list) -> bool:
        """Whether ``layers`` can be rows of one layer: row layers, initialized, with the same host counters and
        the same shapes."""
        if not all(layer.stacks_as_rows and layer.is_initialized for layer in layers):
            return False
        first = layers[0]
        return all(_host(layer) == _host(first) and _shapes(layer) == _shapes(first) for layer in layers)

    def holds(self, layers: list[QEvictLayer]) -> bool:
        """Whether ``layers`` are this stack's, in order, and every tensor of theirs is still its rows."""
        if len(layers) != len(self.layers) or any(a is not b for a, b in zip(layers, self.layers)):
            return False
        first = layers[0]
        stacked = row_tensors(self)
        counters = [self.fp.count, self.recent_origin]
        for index, layer in enumerate(layers):
            if _host(layer) != _host(first):
                return False
            for mine, whole in zip(row_tensors(layer), stacked):
                if not _is_part(mine, whole, index, layer.owner.shape.batch):
                    return False
            for mine, whole in zip([layer.fp.count, layer.recent_origin], counters):
                if not _is_part(mine, whole, index, 1):
                    return False
        return True

    def move_all(self) -> None:
        """Every layer's routing event at once: settle, rank and move the stack's rows."""
        self._follow(self.layers[0])
        settle(self)
        self.move(*self.own_keys())

    def step_table(self, layer: QEvictLayer, key: tuple, build) -> torch.Tensor:
        """A table of a decode step over the whole buffer that every layer reads alike, ``build()`` by the stack as
        the first ``layer`` to ask sees it (its host counters and fill are every layer's once it has appended), then
        read by every other: one set of operators a step, not one a layer. Only moves change what it is built from,
        and a decode step's moves wait for the forward's end, where the cache drops it (``key``: what it is)."""
        tables = self.step_tables = self.step_tables or {}
        if key not in tables:
            self._follow(layer)
            tables[key] = build()
            self.owner.note_workspace(tables[key].nbytes)
        return tables[key]

    def _follow(self, layer: QEvictLayer) -> None:
        """The host counters of ``layer`` (every layer of the stack has the same)."""
        self.seen, self.recent_start, self.reads_buffer = layer.seen, layer.recent_start, layer.reads_buffer
        self.fp.follow(layer.fp)

    def keep_moved(self, full_k, full_v, full_ids, num_aged) -> None:
        super().keep_moved(full_k, full_v, full_ids, num_aged)
        for index, layer in enumerate(self.layers):  # the new tiers: the same storage while the sizes hold
            layer.take_rows(self, index)

    def aged_windows(self) -> torch.Tensor:
        """(L·B, a): the device origin is one per layer (L,), the same value in each."""
        if self.recent_origin is None:
            return super().aged_windows()
        num_aged, b = self.num_aged(), self.owner.shape.batch
        first = self._first_recent()[:, None]  # (L, 1)
        aged = (first + torch.arange(num_aged, device=first.device)).to(torch.int32)  # (L, a)
        return aged[:, None].expand(-1, b, -1).reshape(-1, num_aged)  # (L·B, a), layer-major

    def record_move(self, old, aged) -> None:
        b = self.owner.shape.batch
        for index, layer in enumerate(self.layers):
            rows = slice(index * b, (index + 1) * b)
            layer.record_move((old[0][rows], old[1][rows]), aged[rows])

    def note_moved(self) -> None:
        for layer in self.layers:
            layer.note_moved()


def row_tensors(layer: QEvictLayer) -> list[torch.Tensor | None]:
    """Every tensor ``layer`` keeps per batch row, batch first (what a stack holds as its rows)."""
    ledgers = [layer.quant] + ([layer.dormant] if layer.dormant is not None else [])
    return [layer.fp.keys, layer.fp.values, layer.full_ids, layer.dormant_valid, layer.scores, layer.interval,
            *(getattr(ledger, name) for ledger in ledgers for name in TENSORS)]


def _host(layer: QEvictLayer) -> tuple:
    fp = layer.fp
    return layer.seen, layer.recent_start, layer.reads_buffer, fp.sinks, fp.full, fp.length, fp.reserve


def _shapes(layer: QEvictLayer) -> list:
    tensors = row_tensors(layer) + [layer.fp.count, layer.recent_origin]
    return [None if t is None else (t.shape, t.dtype) for t in tensors]


def _is_part(mine: torch.Tensor | None, whole: torch.Tensor | None, index: int, rows: int) -> bool:
    """Whether ``mine`` is rows [index·rows, (index + 1)·rows) of ``whole`` (by address, not by value)."""
    if mine is None or whole is None:
        return mine is None and whole is None
    if mine.shape[1:] != whole.shape[1:] or mine.shape[0] != rows or whole.shape[0] < (index + 1) * rows:
        return False
    if not whole.numel():
        return True
    return mine.data_ptr() == whole.data_ptr() + index * rows * whole.stride(0) * whole.element_size()
