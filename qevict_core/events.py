"""The one event stream that the CLI, the studio, storage, diagnostics and the benchmarks consume.

Events are small dataclasses with ``to_dict`` / ``event_from_dict``; a lane is one method running on one cache.
Routing events describe batch row 0 (every row is routed; the studio and diagnostics run batch 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


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
    that left the recent region (with their new tier). Windows at positions >= ``recent_start`` are recent.
    ``head``: the KV head routed on its own (``qevict_head``); None when one decision covers every head."""

    lane: str
    step: int
    layer: int
    seen: int
    recent_start: int
    full: list[int]
    quantized: list[int]
    promoted: list[int]
    demoted: list[int]
    evicted: list[int]
    admitted: dict[int, str] = field(default_factory=dict)
    scores: dict[int, float] = field(default_factory=dict)
    head: int | None = None
    kind: str = "routing"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["admitted"] = {str(k): v for k, v in self.admitted.items()}
        # JSON has no NaN or infinity (stores refuse them): a non-finite score is shown as unknown.
        out["scores"] = {str(k): round(v, 6) if math.isfinite(v) else None for k, v in self.scores.items()}
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


def event_from_dict(data: dict):
    kind = data.get("kind")
    if kind == "routing":
        data = dict(data)
        data["admitted"] = {int(k): v for k, v in data.get("admitted", {}).items()}
        data["scores"] = {int(k): v for k, v in data.get("scores", {}).items()}
        return RoutingEvent(**data)
    classes = {"token": TokenEvent, "memory": MemoryEvent, "done": DoneEvent}
    if kind not in classes:
        raise ValueError(f"unknown event kind {kind!r}; allowed: {sorted(classes) + ['routing']}")
    return classes[kind](**data)
