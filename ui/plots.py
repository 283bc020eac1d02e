"""Figures and HTML of a ``RunView``: pure functions, no Gradio.

Plotly figures use ``template="none"`` and rounded values so the JSON Gradio re-sends on every refresh stays
small; they are refreshed at routing events only.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from .view import RunView, window_tier

TIER_COLORS = {"sink": "#6b7280", "recent": "#3b82f6", "full": "#16a34a", "quantized": "#f59e0b",
               "evicted": "#ef4444"}
TIER_CODES = {None: 0, "recent": 1, "full": 2, "quantized": 3, "evicted": 4}
TIER_NAMES = ["not yet", "recent", "full (fp)", "quantized (low-bit)", "evicted"]


def _discrete_scale() -> list:
    colors = ["#ffffff", TIER_COLORS["recent"], TIER_COLORS["full"], TIER_COLORS["quantized"], TIER_COLORS["evicted"]]
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / len(colors), color], [(i + 1) / len(colors), color]]
    return scale


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(template="none", height=260, xaxis={"visible": False}, yaxis={"visible": False},
                      margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def tier_map(view: RunView, lane: str | None, layer: int) -> go.Figure:
    """Windows (y) x routing events (x), coloured by tier; promotions ▲ and demotions ▼ marked."""
    events = view.layer_events(lane, layer) if lane else []
    if not events:
        return empty_figure("The tier map appears at the first routing event of a QEvict lane.")
    sinks, omega = view.sinks, view.omega
    n_windows = max(1, (events[-1]["seen"] - 1 - sinks) // omega + 1)
    z = [[0] * len(events) for _ in range(n_windows)]
    promoted, demoted = ([], []), ([], [])
    for col, event in enumerate(events):
        full, quant = set(event["full"]), set(event["quantized"])
        compact = {**event, "full": full, "quantized": quant}
        for w in range(n_windows):
            z[w][col] = TIER_CODES[window_tier(compact, w, sinks, omega)]
        for w in event["promoted"]:
            promoted[0].append(col), promoted[1].append(w)
        for w in event["demoted"]:
            demoted[0].append(col), demoted[1].append(w)
    steps = [e["step"] for e in events]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(events))), colorscale=_discrete_scale(), zmin=-0.5, zmax=4.5,
                               hovertemplate="event %{x}, window %{y}<extra></extra>",
                               colorbar={"tickvals": list(range(5)), "ticktext": TIER_NAMES, "thickness": 12}))
    fig.add_trace(go.Scatter(x=promoted[0], y=promoted[1], mode="markers", name="promoted Q→F",
                             marker={"symbol": "triangle-up", "color": "#111827", "size": 8}))
    fig.add_trace(go.Scatter(x=demoted[0], y=demoted[1], mode="markers", name="demoted F→Q",
                             marker={"symbol": "triangle-down", "color": "#7c3aed", "size": 8}))
    fig.update_layout(template="none", height=360, margin={"l": 50, "r": 10, "t": 30, "b": 40},
                      title={"text": f"{lane}: layer {layer} tiers per routing event", "font": {"size": 13}},
                      xaxis={"title": "routing event (0 = prefill)", "tickvals": list(range(len(events))),
                             "ticktext": [str(s) for s in steps] if len(events) <= 40 else None},
                      yaxis={"title": f"window (Ω={omega} tokens)"}, legend={"orientation": "h", "y": -0.25})
    return fig


def score_heatmap(view: RunView, lane: str | None) -> go.Figure:
    """Layers (y) x windows (x): each layer's window scores at its latest routing event."""
    layers = view.routing.get(lane, {}) if lane else {}
    if not layers:
        return empty_figure("Cumulative scores appear at the first routing event of a QEvict lane.")
    latest = {layer: events[-1] for layer, events in layers.items()}
    n_windows = 1 + max((max(map(int, e["scores"]), default=0) for e in latest.values()), default=0)
    rows = sorted(latest)
    z = []
    for layer in rows:
        scores = {int(k): v for k, v in latest[layer]["scores"].items()}
        z.append([round(scores[w], 3) if w in scores else None for w in range(n_windows)])
    fig = go.Figure(go.Heatmap(z=z, y=rows, colorscale="Viridis", colorbar={"title": "score", "thickness": 12},
                               hovertemplate="layer %{y}, window %{x}: %{z}<extra></extra>"))
    fig.update_layout(template="none", height=360, margin={"l": 50, "r": 10, "t": 30, "b": 40},
                      title={"text": f"{lane}: cumulative window scores (blank = evicted)", "font": {"size": 13}},
                      xaxis={"title": "window"}, yaxis={"title": "layer", "dtick": max(1, len(rows) // 10)})
    return fig


def prompt_html(view: RunView, lane: str | None, layer: int) -> str:
    """The prompt, each token on the colour of its window's tier at the latest routing event of ``layer``."""
    pieces = view.request.get("prompt_tokens") or []
    events = view.layer_events(lane, layer) if lane else []
    if not pieces:
        return ""
    event = events[-1] if events else None
    if event is not None:
        event = {**event, "full": set(event["full"]), "quantized": set(event["quantized"])}
    spans, current, run = [], None, []
    for position, piece in enumerate(pieces):
        if position < view.sinks:
            tier = "sink"
        elif event is None:
            tier = "recent"
        else:
            tier = window_tier(event, (position - view.sinks) // view.omega, view.sinks, view.omega) or "recent"
        if tier != current and run:
            spans.append(_span(current, run))
            run = []
        current = tier
        run.append(piece)
    if run:
        spans.append(_span(current, run))
    legend = " ".join(f'<span style="background:{c}33;border-bottom:3px solid {c};padding:0 4px">{t}</span>'
                      for t, c in TIER_COLORS.items())
    title = html.escape(f"{lane}, layer {layer}") if lane else "prompt"
    return (f'<div class="qe-prompt"><div style="margin-bottom:6px"><b>{title}</b> — {legend}</div>'
            f'<div style="white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;line-height:1.6;'
            f'max-height:320px;overflow:auto">{"".join(spans)}</div></div>')


def _span(tier: str, pieces: list[str]) -> str:
    color = TIER_COLORS[tier]
    return f'<span title="{tier}" style="background:{color}33">{html.escape("".join(pieces))}</span>'


def lanes_html(view: RunView) -> str:
    """Side-by-side outputs, one card per lane, with live bytes, ratio and speed. Text is escaped."""
    cards = []
    for lane in view.lanes.values():
        stats = f"{len(lane.tokens)} tokens"
        if lane.fullkv_bytes:
            stats += f" · KV {lane.total_bytes / 2**20:.2f} MiB = {lane.ratio:.1%} of FullKV"
        if lane.tokens_per_second:
            stats += f" · {lane.tokens_per_second:.1f} tok/s"
        if lane.done:
            stats += f" · {html.escape(lane.done)}"
        cards.append(
            f'<div class="qe-lane" data-lane="{html.escape(lane.name)}" style="flex:1;min-width:220px;border:1px solid '
            f'#d1d5db;border-radius:8px;padding:8px"><div><b>{html.escape(lane.name)}</b></div>'
            f'<div class="qe-stats" style="font-size:12px;color:#4b5563">{stats}</div>'
            f'<div class="qe-text" style="white-space:pre-wrap;overflow-wrap:anywhere;margin-top:6px">'
            f'{html.escape(lane.text)}</div></div>')
    return f'<div style="display:flex;gap:10px;flex-wrap:wrap">{"".join(cards)}</div>'


STATS_HEADERS = ["lane", "method", "tokens", "KV MiB", "of FullKV", "budget", "prefill s", "tok/s",
                 "promoted", "demoted", "evicted", "agree w/ FullKV", "same prefix"]


def stats_rows(view: RunView) -> list[list]:
    agreement = view.agreement()
    rows = []
    for lane in view.lanes.values():
        agree, prefix = agreement.get(lane.name, (None, None))
        budget = lane.budget_bytes / 2**20 if lane.budget_bytes else None
        evicted = lane.summary.get("evictions", lane.evictions)
        rows.append([lane.name, lane.method, len(lane.tokens), round(lane.total_bytes / 2**20, 3),
                     f"{lane.ratio:.1%}", f"{budget:.3f} MiB" if budget else "—", round(lane.prefill_seconds, 2),
                     round(lane.tokens_per_second, 2), lane.summary.get("promotions", lane.promotions),
                     lane.summary.get("demotions", lane.demotions), evicted,
                     f"{agree:.0%}" if agree is not None else "—", prefix if prefix is not None else "—"])
    return rows
