"""Studio handlers and plot builders as plain functions (no browser)."""

import json

import pytest

from storage import SessionStore, make_engine
from tests.conftest import tiny_chat_model, tiny_tokenizer
from ui import plots
from ui.handlers import NO_LANE, Studio, parse_request
from ui.view import RunView

SETTINGS = dict(budget=0.3, omega=8, q_frac=0.7, bits=2, sinks=5, recent=32, scorer="cumulative", promotion=True)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30 + "What jumps?"


@pytest.fixture(scope="module")
def studio():
    return Studio(tiny_chat_model(), tiny_tokenizer(), SessionStore(make_engine("sqlite://")), "tiny")


def request(prompt=LONG_PROMPT, methods=("fullkv", "snapkv", "qevict"), max_new=24, **overrides):
    return parse_request(prompt, list(methods), **{**SETTINGS, **overrides}, max_new_tokens=max_new)


@pytest.mark.parametrize("prompt, methods, overrides, message", [
    ("", ("qevict",), {}, "prompt is empty"),
    ("   ", ("qevict",), {}, "prompt is empty"),
    ("hi", (NO_LANE, NO_LANE), {}, "at least one lane"),
    ("hi", ("magic",), {}, r"Unknown method.*allowed:.*qevict"),
    ("hi", ("qevict",), {"q_frac": 2.0}, r"q_frac must lie in \[0, 1\]"),
    ("hi", ("qevict",), {"bits": 3}, r"bits must be one of \(2, 4\)"),
    ("hi", ("qevict",), {"scorer": "nope"}, "scorer must be one of"),
])
def test_bad_input_gives_readable_errors(prompt, methods, overrides, message):
    with pytest.raises(ValueError, match=message):
        request(prompt, methods, **overrides)


def test_failures_before_the_run_save_nothing(studio):
    before = len(studio.store.list())
    with pytest.raises(ValueError, match="beyond the model's context of 4096"):
        next(studio.run(request("word " * 5000, ("qevict",))))
    with pytest.raises(ValueError, match="qevict: budget of .* cannot hold the protected regions"):
        next(studio.run(request("short prompt", ("fullkv", "qevict"), budget=0.05)))
    assert len(studio.store.list()) == before


def test_run_streams_persists_and_replays_identically(studio):
    updates = list(studio.run(request()))
    final = updates[-1]
    assert final.status == "done" and len(updates) > 24
    view = final.view
    assert {name: len(lane.tokens) for name, lane in view.lanes.items()} == {"fullkv": 24, "snapkv": 24, "qevict": 24}
    assert view.routed_lanes() == ["qevict"]
    meta = studio.store.get(final.session_id)
    assert meta["status"] == "done" and meta["summary"]["lanes"]["qevict"]["tokens"] == 24
    replayed, last = studio.replay(final.session_id)
    assert last == 23
    assert plots.lanes_html(replayed) == plots.lanes_html(view)
    assert plots.stats_rows(replayed) == plots.stats_rows(view)
    for layer in range(3):
        assert plots.tier_map(replayed, "qevict", layer).to_json() == plots.tier_map(view, "qevict", layer).to_json()
        assert plots.prompt_html(replayed, "qevict", layer) == plots.prompt_html(view, "qevict", layer)
    # A replay at an earlier step shows exactly the tokens streamed by then.
    early, _ = studio.replay(final.session_id, step=5)
    assert [len(lane.tokens) for lane in early.lanes.values()] == [6, 6, 6]


def test_interrupted_run_leaves_a_replayable_partial_session(studio):
    stream = studio.run(request(max_new=40))
    first = next(stream)
    for _ in range(12):
        next(stream)
    stream.close()  # the browser went away / the worker was cancelled mid-stream
    meta = studio.store.get(first.session_id)
    assert meta["status"] == "stopped"
    view, last = studio.replay(first.session_id)
    tokens = sum(len(lane.tokens) for lane in view.lanes.values())
    assert 0 < tokens < 3 * 40 and last < 39


def test_stop_flag_ends_the_run_and_keeps_the_text(studio):
    produced = []

    def stop_after_ten():
        return len(produced) >= 10

    for update in studio.run(request(max_new=60), stop_after_ten):
        produced.append(update)
    assert update.status == "stopped"
    assert all(lane.done == "stopped" for lane in update.view.lanes.values())
    assert studio.store.get(update.session_id)["status"] == "stopped"


def test_text_is_escaped_everywhere(studio):
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)> " * 20
    final = list(studio.run(request(evil, ("qevict",), max_new=4)))[-1]
    html = plots.prompt_html(final.view, "qevict", 1) + plots.lanes_html(final.view)
    assert "<script>" not in html and "<img" not in html and "&lt;script&gt;" in html


def test_tier_map_codes_follow_the_events():
    view = RunView({"lanes": [{"name": "q", "method": "qevict"}], "config": {"sinks": 2, "omega": 4},
                    "prompt_tokens": [str(i) for i in range(30)]})
    view.apply({"kind": "routing", "lane": "q", "step": 0, "layer": 0, "seen": 30, "recent_start": 18,
                "full": [0, 2], "quantized": [1], "promoted": [], "demoted": [], "evicted": [3],
                "scores": {"0": 1.0, "1": 0.5, "2": 0.9, "3": 0.1, "4": 0.2}})
    view.apply({"kind": "routing", "lane": "q", "step": 8, "layer": 0, "seen": 38, "recent_start": 26,
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
    assert list(fig.data[1].x) == [1] and list(fig.data[1].y) == [1]  # the promotion marker
    heat = plots.score_heatmap(view, "q")
    assert list(heat.data[0].z[0])[:5] == [1.0, 2.5, 0.9, None, 0.2]
    html = plots.prompt_html(view, "q", 0)
    assert 'title="sink"' in html and 'title="evicted"' in html
    assert "layout" not in json.loads(fig.to_json())["layout"]["template"]  # template="none": small payloads


def test_diagnostics_of_a_stored_run(studio):
    from ui.handlers import diagnose_session

    final = list(studio.run(request(methods=("fullkv", "qevict"), max_new=32)))[-1]
    table = diagnose_session(studio, final.session_id)
    row = next(line for line in table.splitlines() if line.startswith("| qevict |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert len(cells) == 9 and all(c != "" for c in cells)
    fmm, fmm_fp = float(cells[0]), float(cells[1])
    assert 0 <= fmm <= fmm_fp <= 1
    assert "No such session" in diagnose_session(studio, "nope")
