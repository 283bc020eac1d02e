"""The one event stream that the CLI, the studio, storage, diagnostics and the benchmarks consume.

Each kind of event is declared here once, as a dataclass: the engine emits it, ``storage.schema`` derives the bounded
model a stored or imported event must fit from its fields, and the studio folds the typed objects into its views.
``to_dict`` gives the JSON form (window ids as string keys, non-finite scores as null); ``event_from_dict`` reads it
back. A lane is one method running on one cache. Routing events describe batch row 0 (every row is routed; the
studio and diagnostics run batch 1) and carry their window grid, so a stream redraws without its request.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch

from .engine.layout import WindowGrid


@dataclass
class TokenEvent:
    lane: str
    step: int
    token_id: int
    text: str
    seconds: float = 0.0  # wall time of the forward that produced this token (shared by the lanes in it)
    alone_seconds: float | None = None  # this lane's estimated time alone (generate.lane_seconds); None: untimed
    kind: str = "token"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RoutingEvent:
    """One layer's routing decision. ``full``/``quantized`` list the window ids in each tier after the event;
    ``promoted`` went Q->F, ``demoted`` F->Q, ``evicted`` left the cache at this event; ``admitted`` are windows
    that left the recent region (with their new tier). Windows at positions >= ``recent_start`` are recent; window
    ``w`` covers the positions ``sinks + w*omega ..`` (``grid``). ``head``: the KV head routed on its own
    (``qevict_head``); None when one decision covers every head. A score is None when it was not finite."""

    lane: str
    step: int
    layer: int
    seen: int
    recent_start: int
    sinks: int
    omega: int
    full: list[int]
    quantized: list[int]
    promoted: list[int]
    demoted: list[int]
    evicted: list[int]
    admitted: dict[int, str] = field(default_factory=dict)
    scores: dict[int, float | None] = field(default_factory=dict)
    head: int | None = None
    kind: str = "routing"

    @classmethod
    def after_move(cls, layer, old: tuple, aged: list[int]) -> RoutingEvent:
        """Batch row 0 of ``layer`` (an engine layer) just after a move: ``old`` copies of its full and quantized
        tiers' ids (B, ·) before it, ``aged`` the windows that left the recent region."""
        grid, owner = layer.grid, layer.owner
        old_full, old_quant = set(old[0][0].tolist()), set(old[1][0].tolist())
        full, quant = layer.full_ids[0].tolist(), layer.quant.ids[0].tolist()
        live = set(full) | set(quant)
        evicted = sorted((old_full | old_quant | set(aged)) - live)
        recent = range(grid.window_of(layer.recent_start), grid.window_of(layer.seen - 1) + 1)
        shown = sorted(live | set(evicted) | set(recent))
        ranking = owner.scorer.ranking(layer.scores[0])
        values = ranking[torch.tensor(shown, dtype=torch.long, device=ranking.device)].tolist() if shown else []
        return cls(
            lane="", step=owner.step, layer=layer.layer_idx, head=layer.head, seen=layer.seen,
            recent_start=layer.recent_start, sinks=grid.sinks, omega=grid.omega, full=full, quantized=quant,
            promoted=sorted(set(full) & old_quant), demoted=sorted(set(quant) & old_full), evicted=evicted,
            admitted={w: "full" if w in full else "quantized" if w in quant else "evicted" for w in aged},
            scores=dict(zip(shown, values)),
        )

    @property
    def grid(self) -> WindowGrid:
        return WindowGrid(self.sinks, self.omega)

    def tiers(self, windows: Iterable[int]) -> list[str | None]:
        """The tier of each of ``windows`` after this event: recent, full, quantized or evicted (None: not created
        yet)."""
        grid, full, quantized = self.grid, set(self.full), set(self.quantized)

        def tier(window: int) -> str | None:
            start = grid.start(window)
            if start >= self.seen:
                return None
            if start >= self.recent_start:
                return "recent"
            return "full" if window in full else "quantized" if window in quantized else "evicted"

        return [tier(w) for w in windows]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["admitted"] = {str(k): v for k, v in self.admitted.items()}
        # JSON has no NaN or infinity (stores refuse them): a non-finite score is shown as unknown.
        out["scores"] = {str(k): round(v, 6) if v is not None and math.isfinite(v) else None
                         for k, v in self.scores.items()}
        return out


@dataclass
class MemoryEvent:
    lane: str
    step: int
    total_bytes: int
    fullkv_bytes: int
    budget_bytes: int | None
    peak_bytes: int
    components: dict[str, int]
    tiers: dict[str, int] = field(default_factory=dict)  # tokens per tier (sink ... evicted), mean over layers
    kind: str = "memory"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DoneEvent:
    """End of one lane: why it stopped and its totals."""

    lane: str
    step: int
    reason: str  # "eos", "length", "stopped" or "error"
    text: str
    tokens: int
    prefill_seconds: float
    decode_seconds: float
    summary: dict = field(default_factory=dict)
    kind: str = "done"

    def to_dict(self) -> dict:
        return asdict(self)


Event = TokenEvent | RoutingEvent | MemoryEvent | DoneEvent
# kind -> its class, in the order a lane-step emits them
EVENT_TYPES: dict[str, type] = {cls.__dataclass_fields__["kind"].default: cls
                                for cls in (TokenEvent, RoutingEvent, MemoryEvent, DoneEvent)}


def event_from_dict(data: dict) -> Event:
    """The typed event of a ``to_dict`` form (window ids back to ints), or ValueError naming the kinds allowed."""
    cls = EVENT_TYPES.get(data.get("kind"))
    if cls is None:
        raise ValueError(f"unknown event kind {data.get('kind')!r}; allowed: {sorted(EVENT_TYPES)}")
    fields = dataclasses.fields(cls)
    if unknown := sorted(set(data) - {f.name for f in fields}):
        raise ValueError(f"a {cls.__name__} has no field(s) {unknown}; allowed: {sorted(f.name for f in fields)}")
    required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
    if missing := [name for name in required if name not in data]:
        raise ValueError(f"a {cls.__name__} needs the field(s) {missing}")
    if cls is RoutingEvent:
        data = {**data, "admitted": {int(k): v for k, v in data.get("admitted", {}).items()},
                "scores": {int(k): v for k, v in data.get("scores", {}).items()}}
    return cls(**data)
