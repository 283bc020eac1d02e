"""What a run looks like at some step, rebuilt from its event stream.

Live runs and replays feed the same ``RunView`` with the same typed events (``qevict_core.events``; storage keeps
their JSON form), so a replay redraws exactly what was shown live. Everything here is plain data; ``ui/plots.py``
and ``ui/cards.py`` draw it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qevict_core.engine.layout import WindowGrid
from qevict_core.events import Event, RoutingEvent
from qevict_core.registry import is_reference


@dataclass
class LaneView:
    name: str
    method: str
    note: str = ""  # why this lane runs at another budget than the one asked for
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the text each token added
    total_bytes: int = 0
    fullkv_bytes: int = 0
    budget_bytes: int | None = None
    peak_bytes: int = 0
    tiers: dict[str, int] = field(default_factory=dict)  # tokens per tier in one layer (mean over layers)
    history: list[tuple[int, dict[str, int], int]] = field(default_factory=list)  # (step, components, FullKV bytes)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # of the shared forwards
    step_seconds: list[float] = field(default_factory=list)  # each decode step's shared forward, in order
    alone_seconds: float | None = None  # the lane's own estimate (None when its decode steps were not timed)
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    done: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ms_per_token(self) -> float | None:
        """Decode time per token: the lane's own estimate when timed, else that of the shared forward."""
        decoded = len(self.tokens) - 1
        seconds = self.alone_seconds if self.alone_seconds is not None else self.decode_seconds
        return 1000 * seconds / decoded if decoded > 0 and seconds > 0 else None

    @property
    def ratio(self) -> float:
        return self.total_bytes / self.fullkv_bytes if self.fullkv_bytes else 0.0


class RunView:
    """Lanes, their texts and stats, and per lane and layer the routing events seen so far."""

    def __init__(self, request: dict[str, Any], status: str = "running"):
        self.request = request
        self.status = status  # the run's: running, done, stopped, error, interrupted (a crash or restart)
        self.lanes = {lane["name"]: LaneView(lane["name"], lane["method"], lane.get("note", ""))
                      for lane in request["lanes"]}
        self.routing: dict[str, dict[int, list[RoutingEvent]]] = {name: {} for name in self.lanes}
        self.step = -1

    def config(self, lane: str | None) -> dict[str, Any]:
        """The config ``lane`` ran with (the form's when ``lane`` is None)."""
        if lane is None:
            return self.request["config"]
        return next(spec for spec in self.request["lanes"] if spec["name"] == lane)["config"]

    def sinks(self, lane: str | None) -> int:
        return int(self.config(lane)["sinks"])

    def omega(self, lane: str | None) -> int:
        return int(self.config(lane)["omega"])

    def grid(self, lane: str | None) -> WindowGrid:
        """Where ``lane``'s windows lie (its own sinks and Ω)."""
        return WindowGrid(self.sinks(lane), self.omega(lane))

    @property
    def max_new_tokens(self) -> int:
        return int(self.request["sampling"]["max_new_tokens"])

    @property
    def expected(self) -> str:
        return self.request.get("expected", "")

    def apply(self, event: Event) -> bool:
        """Fold one event in; True when it changes the routing figures."""
        lane = self.lanes[event.lane]
        self.step = max(self.step, event.step)
        if event.kind == "token":
            lane.tokens.append(event.token_id)
            lane.pieces.append(event.text)
            lane.text += event.text
            if len(lane.tokens) == 1:
                lane.prefill_seconds = event.seconds
            else:
                lane.decode_seconds += event.seconds
                lane.step_seconds.append(event.seconds)
                if event.alone_seconds is not None:
                    lane.alone_seconds = (lane.alone_seconds or 0.0) + event.alone_seconds
        elif event.kind == "memory":
            lane.total_bytes, lane.fullkv_bytes = event.total_bytes, event.fullkv_bytes
            lane.budget_bytes, lane.peak_bytes = event.budget_bytes, event.peak_bytes
            lane.tiers = event.tiers
            lane.history.append((event.step, event.components, event.fullkv_bytes))
        elif event.kind == "routing":
            self.routing[lane.name].setdefault(event.layer, []).append(event)
            lane.promotions += len(event.promoted)
            lane.demotions += len(event.demoted)
            lane.evictions += len(event.evicted)
            return True
        elif event.kind == "done":
            lane.done, lane.summary, lane.text = event.reason, event.summary, event.text
        return False

    def routed_lanes(self) -> list[str]:
        return [name for name, layers in self.routing.items() if layers]

    def layer_events(self, lane: str, layer: int, head: int = 0) -> list[RoutingEvent]:
        """Routing events of ``layer``; for a lane routed per KV head (``qevict_head``), those of ``head``."""
        return [e for e in self.routing.get(lane, {}).get(layer, []) if e.head in (None, head)]

    def where(self, lane: str, layer: int, head: int = 0) -> str:
        """'layer 3', or 'layer 3, KV head 1' for a lane routed per head: what a routing figure shows."""
        per_head = any(e.head is not None for e in self.routing.get(lane, {}).get(layer, []))
        return f"layer {layer}, KV head {head}" if per_head else f"layer {layer}"

    def reference(self) -> LaneView | None:
        return next((lane for lane in self.lanes.values() if is_reference(lane.method)), None)

    def agreement(self) -> dict[str, tuple[float, int]]:
        """Per lane: (fraction of positions equal to FullKV's tokens, identical prefix length)."""
        reference = self.reference()
        if reference is None:
            return {}
        out = {}
        for lane in self.lanes.values():
            n = min(len(lane.tokens), len(reference.tokens))
            if lane is reference or n == 0:
                continue
            same = [a == b for a, b in zip(lane.tokens, reference.tokens)]
            prefix = same.index(False) if False in same else n
            out[lane.name] = (sum(same) / n, prefix)
        return out

    def answer_windows(self, lane: str | None) -> dict[str, list[int]]:
        """Each part of the expected answer -> the windows of ``lane``'s grid that hold it in the prompt (the
        first occurrence; a part split over windows gives them all)."""
        pieces = self.request.get("prompt_tokens") or []
        parts = [part.strip() for part in self.expected.split(";") if part.strip()]
        if not pieces or not parts:
            return {}
        text, ends = "", []
        for piece in pieces:
            text += piece
            ends.append(len(text))
        grid = self.grid(lane)
        found = {}
        for part in parts:
            at = text.lower().find(part.lower())
            if at < 0:
                continue
            first = next(i for i, end in enumerate(ends) if end > at)
            last = next(i for i, end in enumerate(ends) if end >= at + len(part))
            found[part] = sorted({grid.window_of(p) for p in range(first, last + 1) if p >= grid.sinks})
        return found

    def token_text(self, lane: str, start: int, stop: int) -> str:
        """The text of absolute positions [start, stop) as ``lane`` saw them (prompt, then its own tokens)."""
        prompt = self.request.get("prompt_tokens") or []
        own = self.lanes[lane].pieces
        return "".join(prompt[i] if i < len(prompt) else own[i - len(prompt)]
                       for i in range(start, stop) if i < len(prompt) + len(own))

