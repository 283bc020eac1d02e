"""The drawings of a run (lane cards, tier map, score heatmap, moves, prompt by tier, progress) from hand-built event
streams, where the right picture is known."""

import json

import pytest

from tests.studio_calls import feed
from ui import cards, plots
from ui.run_tab import picker_index
from ui.texts import progress_text
from ui.view import RunView


def test_lane_cards_point_at_the_result():
    view = RunView({"lanes": [{"name": "fullkv", "method": "fullkv"}, {"name": "snapkv", "method": "snapkv"}],
                    "config": {"sinks": 2, "omega": 4}, "sampling": {"max_new_tokens": 3}, "expected": "42"})
    for lane, pieces in (("fullkv", [" 4", "2", "."]), ("snapkv", [" 4", "1", "."])):
        for step, piece in enumerate(pieces):
            feed(view, {"kind": "token", "lane": lane, "step": step, "token_id": ord(piece[-1]), "text": piece,
                        "seconds": 0.1})
    html = cards.lanes_html(view)
    # found the moment it is there; missing is only a verdict once the lane has ended
    assert '<span class="qe-verdict qe-answer qe-good">✓ found the answer “42”</span>' in html
    assert '<span class="qe-verdict qe-answer qe-pending">… looking for “42”</span>' in html and "✗" not in html
    feed(view, {"kind": "done", "lane": "snapkv", "step": 2, "reason": "length", "text": " 41.", "tokens": 3,
                "prefill_seconds": 0.1, "decode_seconds": 0.2})
    assert '<span class="qe-verdict qe-answer qe-bad">✗ missed the answer “42”</span>' in cards.lanes_html(view)
    # agreement with FullKV is a pill of its own, amber, never the answer's red
    assert '<span class="qe-verdict qe-agree qe-differs">same as FullKV for the first token' in html
    assert "same as FullKV for the first token, then differs (67% of positions agree)" in html
    assert '<span class="qe-diverged" title="differs from FullKV">1.</span>' in html


@pytest.mark.parametrize("reason, status, words", [
    ("stopped", "stopped", "■ it was stopped before finding “42”"),
    (None, "interrupted", "■ the run was interrupted before finding “42”"),
    (None, "running", "… looking for “42”"),
])
def test_a_lane_cut_short_is_neither_found_nor_missed(reason, status, words):
    view = RunView({"lanes": [{"name": "q", "method": "qevict", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 9}, "expected": "42"}, status)
    feed(view, {"kind": "token", "lane": "q", "step": 0, "token_id": 7, "text": "The", "seconds": 0.1})
    if reason:
        feed(view, {"kind": "done", "lane": "q", "step": 0, "reason": reason, "text": "The", "tokens": 1,
                    "prefill_seconds": 0.1, "decode_seconds": 0.0})
    assert words in cards.lanes_html(view) and "✗" not in cards.lanes_html(view)


def test_the_tier_map_marks_the_answers_windows_and_keeps_promotions_on_top():
    pieces = [f"w{i} " for i in range(30)]
    pieces[21] = "the code is 4738"
    pieces[22] = "291. "
    view = RunView({"lanes": [{"name": "q", "method": "qevict", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 8}, "prompt_tokens": pieces, "expected": "4738291"})
    feed(view, {"kind": "routing", "lane": "q", "step": 0, "layer": 0, "seen": 30, "recent_start": 26,
                "full": [0, 1], "quantized": [4, 5], "promoted": [], "demoted": [], "evicted": [2, 3],
                "scores": {}})
    feed(view, {"kind": "routing", "lane": "q", "step": 4, "layer": 0, "seen": 34, "recent_start": 30,
                "full": [1, 4], "quantized": [0, 5, 6], "promoted": [4], "demoted": [0], "evicted": [2, 3],
                "scores": {}})
    assert view.answer_windows("q") == {"4738291": [4, 5]}  # tokens 21-22, windows (21-2)//4 and (22-2)//4
    fig = plots.tier_map(view, "q", 0)
    assert sorted(shape.y0 for shape in fig.layout.shapes) == [4, 5]
    assert any("holds “4738291”" in a.text for a in fig.layout.annotations)
    names = [trace.name for trace in fig.data]
    assert names.index("promoted ▲") > names.index("demoted ▼")  # drawn last: on top
    promoted = fig.data[names.index("promoted ▲")]
    assert list(promoted.y) == [4] and promoted.marker.size > fig.data[names.index("demoted ▼")].marker.size


def test_tier_map_codes_and_moves_follow_the_events():
    view = RunView({"lanes": [{"name": "q", "method": "qevict", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 8}, "prompt_tokens": [str(i % 10) for i in range(30)]})
    feed(view, {"kind": "routing", "lane": "q", "step": 0, "layer": 0, "seen": 30, "recent_start": 18,
                "full": [0, 2], "quantized": [1], "promoted": [], "demoted": [], "evicted": [3],
                "scores": {"0": 1.0, "1": 0.5, "2": 0.9, "3": 0.1, "4": 0.2}})
    feed(view, {"kind": "routing", "lane": "q", "step": 8, "layer": 0, "seen": 38, "recent_start": 26,
                "full": [1, 2], "quantized": [0, 4], "promoted": [1], "demoted": [0], "evicted": [3, 5],
                "scores": {"0": 1.0, "1": 2.5, "2": 0.9, "4": 0.2}})
    fig = plots.tier_map(view, "q", 0)
    z = [list(row) for row in fig.data[0].z]
    codes = plots.TIER_CODES
    assert [row[0] for row in z[:8]] == [codes["full"], codes["quantized"], codes["full"], codes["evicted"],
                                          codes["recent"], codes["recent"], codes["recent"], codes[None]]
    assert [row[1] for row in z[:9]] == [codes["quantized"], codes["full"], codes["full"], codes["evicted"],
                                          codes["quantized"], codes["evicted"], codes["recent"], codes["recent"],
                                          codes["recent"]]
    promoted = next(trace for trace in fig.data if trace.name == "promoted ▲")
    assert list(promoted.x) == [1] and list(promoted.y) == [1]
    heat = plots.score_heatmap(view, "q")
    assert list(heat.data[0].z[0])[:5] == [1.0, 2.5, 0.9, None, 0.2]
    html = cards.prompt_html(view, "q", 0)
    assert 'title="sink"' in html and 'title="evicted"' in html
    moves = cards.moves_html(view, "q", 0)
    # window 1 = positions 6-9 of the prompt ("6789"), promoted at step 8; window 0 demoted
    assert "step 8: window 1 (tokens 6–9, “6789”) promoted: low-bit → full precision" in moves
    assert "step 8: window 0 (tokens 2–5, “2345”) demoted: full precision → low-bit" in moves
    assert "2 window(s) evicted for good (3, 5)" in moves
    assert "layout" not in json.loads(fig.to_json())["layout"]["template"]  # template="none": small payloads


def test_a_round_trip_stays_listed_however_many_moves_follow():
    view = RunView({"lanes": [{"name": "q", "method": "qevict", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 200}, "prompt_tokens": [str(i % 10) for i in range(60)]})

    def route(step, promoted=(), demoted=()):
        feed(view, {"kind": "routing", "lane": "q", "step": step, "layer": 0, "seen": 60 + step,
                    "recent_start": 48 + step, "full": [], "quantized": [], "promoted": list(promoted),
                    "demoted": list(demoted), "evicted": [], "scores": {"0": 1.0}})

    route(0, demoted=[5])  # the prompt's own placement: not a round trip
    route(8, promoted=[5], demoted=[3])
    route(16, promoted=[3])  # window 3: demoted at step 8, back at step 16
    for step in range(24, 200, 8):  # 22 later events, two moves each: far more than the 12 latest lines
        route(step, promoted=[7], demoted=[9])
    assert cards.round_trips(view.layer_events("q", 0)) == [(3, 8, 16)]
    moves = cards.moves_html(view, "q", 0)
    assert "window 3 (tokens 14–17, “4567”) demoted at step 8, promoted back at step 16" in moves
    assert "step 16:" not in moves  # the latest-moves list has moved on; the round trip is still named


def test_a_lane_routed_per_kv_head_shows_the_picked_head():
    view = RunView({"lanes": [{"name": "h", "method": "qevict_head", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 8}, "prompt_tokens": [str(i % 10) for i in range(30)]})
    for head, (full, quantized, promoted) in enumerate([([0], [1], []), ([2], [0], [2])]):
        feed(view, {"kind": "routing", "lane": "h", "step": 8, "layer": 0, "head": head, "seen": 30,
                    "recent_start": 18, "full": full, "quantized": quantized, "promoted": promoted, "demoted": [],
                    "evicted": [], "scores": {"0": 1.0 + head, "1": 0.5, "2": 0.9}})
    codes = plots.TIER_CODES
    for head, tiers in enumerate([("full", "quantized", "evicted"), ("quantized", "evicted", "full")]):
        fig = plots.tier_map(view, "h", 0, head)
        assert [row[0] for row in fig.data[0].z[:3]] == [codes[t] for t in tiers]
        assert f"h: layer 0, KV head {head}," in fig.layout.title.text
        assert list(plots.score_heatmap(view, "h", head).data[0].z[0])[:1] == [1.0 + head]
        assert f"h, layer 0, KV head {head}" in cards.prompt_html(view, "h", 0, head)
    assert "window 2 (tokens 10–13" in cards.moves_html(view, "h", 0, 1)
    assert "promoted" not in cards.moves_html(view, "h", 0, 0)
    assert view.where("h", 0, 1) == "layer 0, KV head 1"
    with pytest.raises(ValueError, match="head: must be a whole number from 0 to 2"):
        picker_index(3, 3, "head")


def test_the_time_left_follows_the_latest_steps_not_the_first():
    from ui.studio import Update

    view = RunView({"lanes": [{"name": "qevict", "method": "qevict", "config": {"sinks": 2, "omega": 4}}], "config": {"sinks": 2, "omega": 4},
                    "sampling": {"max_new_tokens": 200}, "prompt_length": 10})
    # the prompt, a slow first decode step (warm-up), then steady 0.5 s steps
    for step, seconds in enumerate([30.0, 20.0] + [0.5] * 20):
        feed(view, {"kind": "token", "lane": "qevict", "step": step, "token_id": 1, "text": "a", "seconds": seconds})
    text = progress_text(Update(view, "s", "t", False, "running"))
    # 178 tokens left at 0.5 s: 89 s; the mean step so far (2.5 s) would have said 7 min
    assert text == "**Generating…** token 22 of at most 200, about 89 s left at this run's pace.", text


def test_the_moves_list_quotes_a_window_without_the_chat_template_s_markup():
    pieces = ["<|im_start|>", "user", "\n", "hi", "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n", "ok"] * 3
    view = RunView({"lanes": [{"name": "q", "method": "qevict", "config": {"sinks": 2, "omega": 4}}],
                    "config": {"sinks": 2, "omega": 4}, "sampling": {"max_new_tokens": 8}, "prompt_tokens": pieces})
    feed(view, {"kind": "routing", "lane": "q", "step": 0, "layer": 0, "seen": 30, "recent_start": 22,
                "full": [0], "quantized": [1, 2], "promoted": [], "demoted": [], "evicted": [3, 4], "scores": {}})
    feed(view, {"kind": "routing", "lane": "q", "step": 8, "layer": 0, "seen": 38, "recent_start": 30,
                "full": [1], "quantized": [0, 2], "promoted": [1], "demoted": [0], "evicted": [3, 4],
                "scores": {}})
    moves = cards.moves_html(view, "q", 0)
    assert "window 1 (tokens 6–9" in moves and "promoted" in moves  # tokens 2-5 hold "hi<|im_end|>\n<|im_start|>"
    assert "im_end" not in moves and "im_start" not in moves and "&lt;|" not in moves
