"""Plotly figures of a ``RunView``: pure functions, no Gradio.

Figures use ``template="none"`` and rounded values so the JSON Gradio re-sends on every refresh stays small; they
are refreshed at routing events only. Legends sit above the plot area and colour scales are horizontal, so on a
390 px phone screen the data keeps most of the width.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .cards import TIER_COLORS
from .view import RunView

TIER_CODES = {None: 0, "recent": 1, "full": 2, "quantized": 3, "evicted": 4}
TIER_NAMES = ["not yet", "recent", "full precision", "low-bit", "evicted"]
# Memory components grouped for the stacked bytes plot: what a reader can tell apart.
BYTE_GROUPS = {
    "full precision": ("sink", "recent", "full", "reserved", "outliers"),
    "low-bit codes": ("quantized", "staged"),
    "low-bit scales": ("quant_meta",),
    "bookkeeping": ("index", "ledger", "scores"),
}
GROUP_COLORS = {"full precision": TIER_COLORS["full"], "low-bit codes": TIER_COLORS["quantized"],
                "low-bit scales": "#fcd34d", "bookkeeping": "#9ca3af"}
MiB = 2**20
# Drawing bounds: a figure never holds more cells than this, whatever a stored session names (a long run at a small
# Ω is shown by every k-th window and evenly spaced routing events, and the axis says so).
MAX_CELLS = 120_000
MAX_EVENTS_DRAWN = 240
MAX_WINDOWS_DRAWN = 1_000
TOP_LEGEND = {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "font": {"size": 11}}
# Presentation mode (a projector): every size of a routing figure times this, type and marks alike
LARGE = 1.6


def _layout(fig: go.Figure, title: str, height: int = 380, bottom: int = 45, large: bool = False) -> go.Figure:
    k = LARGE if large else 1.0
    # The toolbar stands upright at the right edge, so it never covers the title on a narrow screen.
    fig.update_layout(template="none", height=round(height * k), font={"size": round(12 * k)},
                      margin={"l": round(50 * k), "r": 30, "t": round(70 * k), "b": round(bottom * k)},
                      title={"text": title, "font": {"size": round(13 * k)}, "y": 0.98, "yanchor": "top"},
                      legend={**TOP_LEGEND, "font": {"size": round(11 * k)}}, modebar={"orientation": "v"})
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(template="none", height=200, xaxis={"visible": False}, yaxis={"visible": False},
                      margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def tier_map(view: RunView, lane: str | None, layer: int, head: int = 0, large: bool = False) -> go.Figure:
    """Windows (y) x routing events (x), coloured by tier; promotions ▲ and demotions ▼ marked. ``large``: sized
    for a projector (presentation mode)."""
    events = view.layer_events(lane, layer, head) if lane else []
    if not events:
        return empty_figure("The tier map appears at the first routing event of a QEvict lane.")
    grid = events[-1].grid
    n_windows = max(1, grid.window_of(events[-1].seen - 1) + 1)
    shown = _spaced(len(events), MAX_EVENTS_DRAWN)  # indices of the events drawn, the last one included
    every = max(1, -(-n_windows * len(shown) // MAX_CELLS))  # draw every k-th window
    rows = range(0, n_windows, every)
    z = [[0] * len(shown) for _ in rows]
    promoted, demoted = ([], []), ([], [])
    for col, index in enumerate(shown):
        event = events[index]
        for row, tier in enumerate(event.tiers(rows)):
            z[row][col] = TIER_CODES[tier]
        for w in event.promoted:
            promoted[0].append(col), promoted[1].append(w)
        for w in event.demoted:
            demoted[0].append(col), demoted[1].append(w)
    events = [events[i] for i in shown]
    colors = ["#ffffff", TIER_COLORS["recent"], TIER_COLORS["full"], TIER_COLORS["quantized"], TIER_COLORS["evicted"]]
    scale = [[bound, color] for i, color in enumerate(colors) for bound in (i / 5, (i + 1) / 5)]
    steps = [e.step for e in events]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(events))), y=list(rows), colorscale=scale, zmin=-0.5, zmax=4.5,
                               showscale=False, customdata=[[TIER_NAMES[c] for c in row] for row in z],
                               hovertemplate="event %{x}, window %{y}: %{customdata}<extra></extra>"))
    k = LARGE if large else 1.0
    for name, color in zip(TIER_NAMES[1:], colors[1:]):  # a legend instead of a colour bar
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker={"symbol": "square", "size": round(10 * k), "color": color}))
    # Demotions first and small, promotions last, larger and outlined: a promotion, the event the method exists
    # for, stays visible when a window row is a pixel high and its neighbours are demoted at the same event.
    outline = {"width": 1.5, "color": "#ffffff"}
    fig.add_trace(go.Scatter(x=demoted[0], y=demoted[1], mode="markers", name="demoted ▼",
                             marker={"symbol": "triangle-down", "color": "#7c3aed", "size": round(7 * k),
                                     "line": outline},
                             hovertemplate="event %{x}: window %{y} demoted<extra></extra>"))
    fig.add_trace(go.Scatter(x=promoted[0], y=promoted[1], mode="markers", name="promoted ▲",
                             marker={"symbol": "triangle-up", "color": "#111827", "size": round(13 * k),
                                     "line": outline},
                             hovertemplate="event %{x}: window %{y} promoted back<extra></extra>"))
    for part, windows in view.answer_windows(lane).items():  # where the expected answer sits in the prompt
        for window in windows:
            fig.add_hline(y=window, line={"color": "#0ea5e9", "width": 2, "dash": "dot"})
        fig.add_annotation(x=len(shown) - 0.5, y=windows[0], xanchor="right", yanchor="bottom", showarrow=False,
                           text=f"holds “{part[:24]}”", font={"size": round(11 * k), "color": "#0369a1"},
                           bgcolor="rgba(255,255,255,0.8)")
    fig = _layout(fig, f"{lane}: {view.where(lane, layer, head)}, tier of each window per routing event", large=large)
    fig.update_layout(xaxis={"title": "routing event (decode step)", "tickvals": list(range(len(events))),
                             "ticktext": [str(s) for s in steps] if len(events) <= 40 else None},
                      yaxis={"title": f"window ({grid.omega} tokens)" if every == 1 else
                             f"every {every}th window ({grid.omega} tokens each)"})
    return fig


def _spaced(n: int, most: int) -> list[int]:
    """``most`` indices spread evenly over range(n), first and last included (all of them when n <= most)."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def score_heatmap(view: RunView, lane: str | None, head: int = 0, large: bool = False) -> go.Figure:
    """Layers (y) x windows (x): each layer's window scores at its latest routing event (of ``head`` for a lane
    routed per KV head)."""
    layers = {layer: view.layer_events(lane, layer, head) for layer in view.routing.get(lane, {})} if lane else {}
    latest = {layer: events[-1] for layer, events in layers.items() if events}
    if not latest:
        return empty_figure("Cumulative scores appear at the first routing event of a QEvict lane.")
    per_head = any(e.head is not None for e in latest.values())
    n_windows = 1 + max((max(e.scores, default=0) for e in latest.values()), default=0)
    rows = sorted(latest)
    width = max(1, -(-n_windows // max(1, min(MAX_WINDOWS_DRAWN, MAX_CELLS // len(rows)))))  # windows per column
    z = []
    for layer in rows:
        line: list[float | None] = [None] * (-(-n_windows // width))
        for window, value in latest[layer].scores.items():
            column = window // width
            if value is not None and (line[column] is None or value > line[column]):
                line[column] = value  # a column of several windows shows the largest score among them
        z.append([None if v is None else round(v, 3) for v in line])
    x = [c * width for c in range(len(z[0]))]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=rows, colorscale="Viridis",
                               # below the axis: above it, the colour bar covered the title
                               colorbar={"title": {"text": "score", "side": "right"}, "orientation": "h",
                                         "thickness": 8, "len": 0.6, "y": -0.32, "yanchor": "top"},
                               hovertemplate="layer %{y}, window %{x}: %{z}<extra></extra>"))
    fig = _layout(fig, f"{lane}{f', KV head {head}' if per_head else ''}: cumulative attention per window "
                       "(blank = evicted)", height=420, bottom=110, large=large)
    fig.update_layout(xaxis={"title": "window" if width == 1 else f"window (each column the largest of {width})"},
                      yaxis={"title": "layer", "dtick": max(1, len(rows) // 10)})
    return fig


def bytes_plot(view: RunView) -> go.Figure:
    """Per lane, the measured KV bytes over the run, stacked by what holds them, with FullKV's for reference."""
    lanes = [lane for lane in view.lanes.values() if lane.history]
    if not lanes:
        return empty_figure("Bytes per tier appear once the prompt is read.")
    fig = make_subplots(rows=1, cols=len(lanes), shared_yaxes=True, subplot_titles=[lane.name for lane in lanes],
                        horizontal_spacing=0.04)
    in_legend: set[str] = set()
    for col, lane in enumerate(lanes, start=1):
        steps = [step for step, _, _ in lane.history]
        series = {group: [round(sum(c.get(p, 0) for p in parts) / MiB, 4) for _, c, _ in lane.history]
                  for group, parts in BYTE_GROUPS.items()}
        series["FullKV"] = [round(f / MiB, 4) for _, _, f in lane.history]
        for group, values in series.items():
            if not any(values):
                continue
            style = ({"mode": "lines", "line": {"dash": "dot", "color": "#111827", "width": 1}} if group == "FullKV"
                     else {"mode": "lines", "stackgroup": f"lane{col}",
                           "line": {"width": 0.5, "color": GROUP_COLORS[group]}})
            fig.add_trace(go.Scatter(x=steps, y=values, name=group, legendgroup=group,
                                     showlegend=group not in in_legend, **style), row=1, col=col)
            in_legend.add(group)
    # "decode step" is said once in the title, not under each lane's axis: on a phone the legend wraps into rows
    # below the ticks, where those axis titles sat
    fig = _layout(fig, "KV bytes by decode step, stacked by tier (MiB)", height=340)
    fig.update_layout(legend={"orientation": "h", "y": -0.15, "yanchor": "top", "x": 0},
                      margin={"l": 50, "r": 10, "t": 60, "b": 90})
    return fig
