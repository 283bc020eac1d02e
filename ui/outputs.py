"""What the studio's handlers take and return, by name (``ui/named.py`` wires each name to its component).

A view panel (``ViewOutputs``) is one field per component of ``blocks.view_panel``, each with its drawing: a new
panel is a drawing, a field here and a component line there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import gradio as gr

from . import cards, plots
from .named import Outputs, keep
from .view import RunView

NO_RUN = plots.empty_figure("No run yet.")


@dataclass
class Shown:
    """A view's pickers as sent (an API client can send anything): the layer and KV head drawn, the lane whose
    routing is drawn, and whether the figures are drawn for a projector (presentation mode)."""

    layer: Any = 0
    head: Any = 0
    shown_lane: Any = None
    present: Any = False


@dataclass(frozen=True)
class At:
    """What a view draws: a checked layer and head, and the routed lane picked (None: no lane has routed)."""

    layer: int
    head: int
    lane: str | None
    present: bool = False  # large type and figures (presentation mode)


def panel(draw: Callable[[RunView, At], Any], blank: Callable[[], Any], routing: bool = False):
    """A view panel's field: its drawing of a run, what it shows without one, and whether it follows the routing
    pickers (redrawn when they change)."""
    return field(default_factory=gr.skip, metadata={"draw": draw, "blank": blank, "routing": routing})


@dataclass
class ViewOutputs(Outputs):
    """A run as the Run and Replay tabs show it."""

    lanes: Any = panel(lambda view, at: cards.lanes_html(view), lambda: "")
    stats: Any = panel(lambda view, at: cards.stats_table(view), lambda: {"headers": ["measure"], "data": []})
    memory: Any = panel(lambda view, at: plots.bytes_plot(view), lambda: NO_RUN)
    tier: Any = panel(lambda view, at: plots.tier_map(view, at.lane, at.layer, at.head, at.present), lambda: NO_RUN,
                      True)
    heat: Any = panel(lambda view, at: plots.score_heatmap(view, at.lane, at.head, at.present), lambda: NO_RUN, True)
    moves: Any = panel(lambda view, at: cards.moves_html(view, at.lane, at.layer, at.head), lambda: "", True)
    prompt: Any = panel(lambda view, at: cards.prompt_html(view, at.lane, at.layer, at.head), lambda: "", True)

    @classmethod
    def drawn(cls, view: RunView | None, at: At | None, only: Callable[[str, bool], bool] = lambda name, r: True):
        """The panels ``only(name, follows the pickers)`` picks, drawn from ``view`` (blank without one); the rest
        kept."""
        out = cls()
        for f in fields(cls):
            if only(f.name, f.metadata["routing"]):
                setattr(out, f.name, f.metadata["draw"](view, at) if view is not None else f.metadata["blank"]())
        return out

    @classmethod
    def cleared(cls) -> ViewOutputs:
        return cls.drawn(None, None)

    @classmethod
    def routing(cls, view: RunView | None, at: At | None) -> ViewOutputs:
        """The panels that follow the pickers."""
        return cls.drawn(view, at, lambda name, routing: routing)


@dataclass
class RunOutputs(Outputs):
    status: Any = keep()
    view: ViewOutputs = field(default_factory=ViewOutputs)
    share: Any = keep()
    ref: Any = keep()  # a new run's {id, token}, for this browser's list of sessions


@dataclass
class ReplayOutputs(Outputs):
    status: Any = keep()
    step: Any = keep()
    shown_lane: Any = keep()  # the routed lanes of the session, the one drawn selected
    view: ViewOutputs = field(default_factory=ViewOutputs)


@dataclass
class TickOutputs(ReplayOutputs):
    timer: Any = keep()


@dataclass
class OpenOutputs(Outputs):
    """A session opened in the Replay tab from elsewhere (a row of Sessions, a share link)."""

    tabs: Any = keep()
    replay_id: Any = keep()  # the Replay tab's session id box
    replay: ReplayOutputs = field(default_factory=ReplayOutputs)


@dataclass
class LoadOutputs(OpenOutputs):
    table: Any = keep()  # this browser's sessions
    present: Any = keep()  # presentation mode, when the link asks for it (&present=1)


@dataclass
class DraftOutputs(Outputs):
    """The form's text a draft keeps (and a restart brings back, with a word in the status line)."""

    prompt: Any = keep()
    expected: Any = keep()
    max_new_tokens: Any = keep()
    status: Any = keep()


@dataclass
class ExampleOutputs(DraftOutputs):
    """An example sets the draft's fields and its own settings."""

    layer: Any = keep()
    hint: Any = keep()
    budget: Any = keep()
    temperature: Any = keep()
    seed: Any = keep()


@dataclass
class EditedOutputs(Outputs):
    expected: Any = keep()
    example: Any = keep()
    hint: Any = keep()
