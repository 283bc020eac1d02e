"""HTML and table rows of a ``RunView``: the lane cards, the prompt coloured by tier, routing moves in words and
the stats table. Pure functions; every piece of text that came from a visitor or the model is escaped."""

from __future__ import annotations

import html
import re

from qevict_core.events import RoutingEvent
from qevict_core.registry import is_reference

from .view import LaneView, RunView

TIER_COLORS = {"sink": "#6b7280", "recent": "#3b82f6", "full": "#16a34a", "quantized": "#f59e0b",
               "evicted": "#ef4444"}
TIER_WORDS = {"sink": "sink", "recent": "recent", "full": "full precision", "quantized": "low-bit",
              "evicted": "evicted"}
MiB = 2**20
SPECIAL = re.compile(r"<\|[^|<>]{1,32}\|>")  # a chat template's markup tokens, <|im_end|> and the like


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def answer_parts(expected: str) -> list[str]:
    """An expected answer's parts: "a; b" asks for both."""
    return [part.strip() for part in expected.split(";") if part.strip()]


def verdict(view: RunView, lane: LaneView) -> list[tuple[str, str]]:
    """(css classes, words) of a lane's pills: whether it found the expected answer (only where the prompt has one:
    pending while the lane runs, then green, red, or grey for a lane stopped before it could), and, apart, how far it
    agrees with FullKV (grey when the same, amber when it differs: a lane can find the answer in other words)."""
    pills = []
    expected = view.expected
    if expected:
        parts = answer_parts(expected)
        hits = [p for p in parts if p.lower() in lane.text.lower()]
        ended = lane.done in ("eos", "length")
        cut = lane.done is not None and not ended or lane.done is None and view.status not in ("running",)
        if len(hits) == len(parts):
            pills.append(("qe-answer qe-good", f"✓ found the answer “{expected}”"))
        elif cut:
            how = "the run was interrupted" if view.status == "interrupted" else "it was stopped"
            pills.append(("qe-answer qe-cut", f"■ {how} before finding “{expected}”"
                          + (f" ({len(hits)} of {len(parts)} parts so far)" if hits else "")))
        elif not ended:
            pills.append(("qe-answer qe-pending", f"… looking for “{expected}”"
                          + (f": {len(hits)} of {len(parts)} parts so far" if hits else "")))
        elif hits:
            pills.append(("qe-answer qe-bad", f"✗ found {len(hits)} of {len(parts)} parts of the answer "
                                              f"(“{'; '.join(hits)}”)"))
        else:
            pills.append(("qe-answer qe-bad", f"✗ missed the answer “{expected}”"))
    agreement = view.agreement().get(lane.name)
    if is_reference(lane.method):
        pills.append(("qe-agree qe-same", "the reference: nothing compressed"))
    elif agreement is not None:
        share, prefix = agreement
        reference = view.reference()
        if prefix == len(lane.tokens) == len(reference.tokens):
            pills.append(("qe-agree qe-same", "✓ same tokens as FullKV"))
        else:
            first = "the first token" if prefix == 1 else f"the first {prefix} tokens"
            pills.append(("qe-agree qe-differs", f"same as FullKV for {first}, then differs "
                                                 f"({share:.0%} of positions agree)" if prefix else
                          f"differs from FullKV from its first token ({share:.0%} of positions agree)"))
    return pills


def lanes_html(view: RunView) -> str:
    """Side-by-side outputs, one card per lane: verdict, bytes, tiers, speed; text after the first token that
    differs from FullKV is underlined."""
    cards = []
    agreement = view.agreement()
    for lane in view.lanes.values():
        pills = "".join(f' <span class="qe-verdict {css}">{_esc(words)}</span>' for css, words in verdict(view, lane))
        stats = [f"{len(lane.tokens)} tokens"]
        if lane.fullkv_bytes:
            stored = view.config(lane.name).get("kv_dtype", "model")
            stored = "the model's dtype" if stored == "model" else stored
            stats.append(f"KV {lane.total_bytes / MiB:.2f} MiB = {lane.ratio:.1%} of FullKV, both in {stored}")
        if lane.tiers:
            stats.append("per layer: " + ", ".join(f"{lane.tiers[t]} {TIER_WORDS[t]}" for t in TIER_WORDS
                                                   if lane.tiers.get(t)) + " tokens")
        if lane.ms_per_token:
            how = ("its share of the lanes' shared forward, under this machine's load at the time; Replay → “Time "
                   "the lanes alone” measures each alone" if lane.alone_seconds is not None else
                   "the lanes' shared forward")
            stats.append(f"{lane.ms_per_token:.0f} ms per token in this run ({how})")
        if lane.done:
            stats.append(_esc(lane.done))
        prefix = agreement.get(lane.name, (None, len(lane.tokens)))[1]
        same = "".join(lane.pieces[:prefix])
        same, rest = (same, lane.text[len(same):]) if lane.text.startswith(same) else (lane.text, "")
        note = f'<div class="qe-note">{_esc(lane.note)}</div>' if lane.note else ""
        cards.append(
            f'<div class="qe-lane" data-lane="{_esc(lane.name)}"><div><b>{_esc(lane.name)}</b>{pills}</div>{note}'
            f'<div class="qe-stats">{" · ".join(stats)}</div>'
            f'<div class="qe-text">{_esc(same)}<span class="qe-diverged" title="differs from FullKV">'
            f'{_esc(rest)}</span></div></div>')
    return f'<div class="qe-lanes">{"".join(cards)}</div>'


def prompt_html(view: RunView, lane: str | None, layer: int, head: int = 0) -> str:
    """The user's prompt (no chat-template markup), each token on the colour of its window's tier at the latest
    routing event of ``layer`` (and ``head``, for a lane routed per KV head)."""
    pieces = view.request.get("prompt_tokens") or []
    if not pieces:
        return ""
    start, stop = view.request.get("prompt_span") or (0, len(pieces))
    events = view.layer_events(lane, layer, head) if lane else []
    event = events[-1] if events else None
    grid = event.grid if event is not None else view.grid(lane)
    sinks = grid.sinks
    windows = range(grid.window_of(max(start, sinks)), grid.window_of(max(stop, sinks + 1) - 1) + 1)
    window_tiers = dict(zip(windows, event.tiers(windows))) if event is not None else {}
    spans, current, run = [], None, []
    for position in range(start, stop):
        if position < sinks:
            tier = "sink"
        else:
            tier = window_tiers.get(grid.window_of(position)) or "recent"
        if tier != current and run:
            spans.append(_span(current, run))
            run = []
        current = tier
        run.append(pieces[position])
    if run:
        spans.append(_span(current, run))
    legend = " ".join(f'<span class="qe-key" style="background:{c}33;border-bottom:3px solid {c}">{TIER_WORDS[t]}'
                      f'</span>' for t, c in TIER_COLORS.items())
    hidden = len(pieces) - (stop - start)
    title = _esc(f"{lane}, {view.where(lane, layer, head)}") if lane else "prompt"
    note = (f" The chat template adds {hidden} tokens around it (the first {sinks} are the attention sinks);"
            " they are not shown." if hidden else "")
    return (f'<div class="qe-prompt"><div><b>{title}</b> — {legend}</div><div class="qe-caption">Your prompt, '
            f'each token on the colour of its window\'s tier after the latest routing event.{note}</div>'
            f'<div class="qe-prompt-text">{"".join(spans)}</div></div>')


def _span(tier: str, pieces: list[str]) -> str:
    return f'<span title="{TIER_WORDS[tier]}" style="background:{TIER_COLORS[tier]}33">{_esc("".join(pieces))}</span>'


def round_trips(events: list[RoutingEvent]) -> list[tuple[int, int, int]]:
    """(window, step demoted, step promoted back) for each window that decoding demoted and later promoted: the
    event the method exists for, kept apart so that later moves never push it out of the list."""
    demoted_at, trips = {}, []
    for event in events:
        if event.step > 0:
            trips += [(w, demoted_at.pop(w), event.step) for w in event.promoted if w in demoted_at]
            demoted_at.update({w: event.step for w in event.demoted})
    return trips


def moves_html(view: RunView, lane: str | None, layer: int, head: int = 0, limit: int = 12) -> str:
    """The round trips and the latest promotions and demotions of ``layer`` (and ``head``) in words, with the text
    of each window."""
    events = view.layer_events(lane, layer, head) if lane else []
    grid = events[-1].grid if events else view.grid(lane)

    def window_words(window: int) -> str:
        first, last = grid.start(window), grid.start(window + 1) - 1
        text = SPECIAL.sub(" ", view.token_text(lane, first, last + 1))  # the chat template's markup
        snippet = " ".join(text.split())[:60]
        return f"window {window} (tokens {first}–{last}, “{_esc(snippet)}”)"

    trips = "".join(f"<li>{window_words(w)} demoted at step {down}, promoted back at step {up}</li>"
                    for w, down, up in round_trips(events)[:limit])
    trips = f'Round trips (demoted, then promoted back):<ul class="qe-trips">{trips}</ul>' if trips else ""
    lines = []
    for event in reversed(events):
        for window, move in ([(w, "promoted: low-bit → full precision") for w in event.promoted]
                             + [(w, "demoted: full precision → low-bit") for w in event.demoted]):
            lines.append(f"<li>step {event.step}: {window_words(window)} {move}</li>")
        if event.evicted:
            lines.append(f"<li>step {event.step}: {len(event.evicted)} window(s) evicted for good "
                         f"({', '.join(map(str, event.evicted[:8]))}{'…' if len(event.evicted) > 8 else ''})"
                         f"</li>")
        if len(lines) >= limit:
            break
    if not lines:
        return ('<div class="qe-moves">No routing moves yet in this layer: windows move at routing events, every '
                'Ω generated tokens.</div>')
    return (f'<div class="qe-moves"><b>{_esc(f"{lane}, {view.where(lane, layer, head)}")}: routing moves</b><br>'
            f'{trips}Latest moves:<ul>{"".join(lines[:limit])}</ul></div>')


MEASURES = ["tokens", "KV MiB", "% of FullKV", "full-precision tokens", "low-bit tokens", "evicted tokens",
            "promotions", "demotions", "ms per token in this run", "% same as FullKV"]


def stats_table(view: RunView) -> dict:
    """Measures (rows) x lanes (columns), one unit per row, so three lanes fit a phone screen. Token rows are per
    layer (mean over layers), moves are windows summed over layers, time is the lane's estimate alone."""
    agreement = view.agreement()
    columns = []
    for lane in view.lanes.values():
        agree = agreement.get(lane.name, (None, None))[0]
        tiers, ms = lane.tiers, lane.ms_per_token
        columns.append([len(lane.tokens), round(lane.total_bytes / MiB, 3), round(100 * lane.ratio, 1),
                        tiers.get("sink", 0) + tiers.get("recent", 0) + tiers.get("full", 0),
                        tiers.get("quantized", 0), tiers.get("evicted", 0), lane.promotions, lane.demotions,
                        round(ms, 1) if ms else None, round(100 * agree) if agree is not None else None])
    rows = [[measure, *(column[i] for column in columns)] for i, measure in enumerate(MEASURES)]
    return {"headers": ["measure", *view.lanes], "data": rows}
