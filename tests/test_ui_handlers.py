"""Studio handlers, the request door and the drawing functions as plain functions (no browser)."""

import json

import pytest
from sqlalchemy import func, select, text
from sqlalchemy import update as sql_update

from storage import SessionStore, make_engine
from storage.db import EventRow, SessionRow
from qevict_core import make_cache
from tests.conftest import tiny_chat_model, tiny_model, tiny_tokenizer
from tests.studio_calls import SETTINGS, diagnostics_text, feed, request
from ui import cards, plots, sessions
from ui.control import TabRuns
from ui.examples import EXAMPLES
from ui.form import NO_LANE, Controls, parse_request
from ui.studio import Studio
from ui.texts import progress_text
from ui.view import RunView


@pytest.fixture(scope="module")
def studio():
    return Studio(tiny_chat_model(), tiny_tokenizer(), SessionStore(make_engine("sqlite://")), "tiny")


@pytest.mark.parametrize("prompt, methods, overrides, message", [
    ("", ("qevict",), {}, "Prompt: it is empty"),
    ("   ", ("qevict",), {}, "Prompt: it is empty"),
    ("hi", (NO_LANE, NO_LANE), {}, "at least one lane"),
    ("hi", ("magic",), {}, r"unknown method.*allowed:.*qevict"),
    ("hi", ("qevict",), {"q_frac": 2.0}, r"q \(quantized share\): .*less than or equal to 1 \(got 2.0\)"),
    ("hi", ("qevict",), {"bits": 3}, r"bits: .*must be one of \(2, 4\) \(got 3\)"),
    ("hi", ("qevict",), {"coverage": 1.5}, r"coverage κ: .*less than or equal to 1 \(got 1.5\)"),
    ("hi", ("qevict",), {"coverage": float("nan")}, "coverage κ: Input should be a finite number"),
    ("hi", ("qevict",), {"scorer": "nope"}, "scorer: .*must be one of"),
    ("hi", ("qevict",), {"budget": float("nan")}, r"KV budget: Input should be a finite number \(got nan\)"),
    ("hi", ("qevict",), {"budget": float("inf")}, "KV budget: Input should be a finite number"),
    ("hi", ("qevict",), {"budget": 1.5}, "KV budget: .*less than or equal to 1"),
    ("hi", ("qevict",), {"omega": 8.5}, r"Ω .*whole number \(got 8.5\)"),
    ("hi", ("qevict",), {"seed": "16"}, r"seed: Input should be a valid integer \(got '16'\)"),
    ("hi", ("qevict",), {"promotion": "yes"}, "promotion: Input should be a valid boolean"),
    ("hi", ("qevict",), {"bits": "2"}, "bits: Input should be a valid integer"),
    (12345, ("qevict",), {}, "Prompt: Input should be a valid string"),
    (["hi"], ("qevict",), {}, "Prompt: Input should be a valid string"),
    ("hi", ({"method": "qevict"},), {}, "Lanes: Input should be a valid string"),
    ("hi", ("qevict",), {"omega": "eight"}, "Ω .*valid integer"),
    ("hi", ("qevict",), {"temperature": float("nan")}, "temperature: Input should be a finite number"),
    ("x" * 200_001, ("qevict",), {}, "Prompt: .*at most 200000 characters"),
])
def test_bad_input_gives_readable_errors(prompt, methods, overrides, message):
    with pytest.raises(ValueError, match=message):
        request(prompt, methods, **overrides)


def test_coverage_from_the_form_reaches_the_cache_and_the_stored_request(studio):
    assert request().config.coverage == 0.7  # the slider's default is the default's coverage
    assert request(coverage=0.0).config.coverage is None  # 0: Eq. 3's split by q
    final = list(studio.run(request(methods=("qevict",), coverage=0.7, budget=0.6)))[-1]
    assert final.status == "done"
    stored = studio.store.get(final.session_id)["request"]["config"]
    assert stored["coverage"] == 0.7
    lane = final.view.lanes["qevict"]
    assert lane.total_bytes <= lane.budget_bytes
    assert stored["kv_dtype"] == "bfloat16" and "of FullKV, both in bfloat16" in cards.lanes_html(final.view)
    by_q = list(studio.run(request(methods=("qevict",), coverage=0.0, budget=0.6)))[-1].view.lanes["qevict"].summary
    # At 60% of this short sequence INT2 windows for 70% of it fit with bytes to spare: fewer INT2 windows than
    # q = 0.7's split, and the rest buys more full ones.
    assert lane.summary["k_quant"] < by_q["k_quant"] and lane.summary["k_full"] > by_q["k_full"]


def test_failures_before_the_run_save_nothing(studio):
    def stored():
        with studio.store.engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(SessionRow))

    before = stored()
    with pytest.raises(ValueError, match="beyond the model's context of 16384"):
        next(studio.run(request("word " * 4000, ("qevict",))))
    assert stored() == before


@pytest.mark.parametrize("name", [name if i == 0 else pytest.param(name, marks=pytest.mark.slow)
                                  for i, name in enumerate(EXAMPLES)])  # the fast suite runs the first
def test_every_example_runs_every_default_lane(studio, name):
    """No default path ends in "Cannot run": a lane that cannot exist at the chosen budget on a short sequence runs
    at the least it can, and its note says so in words."""
    example = EXAMPLES[name]()
    new = min(example.max_new_tokens, 64)
    req = parse_request(Controls(prompt=example.prompt, budget=0.2, omega=8, q_frac=0.7, bits=4, sinks=5, recent=32,
                                 scorer="cumulative", promotion=True, max_new_tokens=new, expected=example.expected))
    final = list(studio.run(req))[-1]
    assert final.status == "done" and example.hint
    for lane in final.view.lanes.values():
        assert len(lane.tokens) == new
        assert lane.budget_bytes is None or lane.total_bytes <= lane.budget_bytes
    specs = {lane["name"]: lane for lane in studio.store.get(final.session_id)["request"]["lanes"]}
    for name_, lane in final.view.lanes.items():
        if "budget_bytes" in specs[name_]:
            assert lane.note.startswith("Runs at ") and "the least this method can run with" in lane.note
            assert lane.budget_bytes == specs[name_]["budget_bytes"]


def test_a_short_prompt_raises_only_the_lanes_that_need_it(studio):
    input_ids, lanes, spec = studio.prepare(request("Hi!", ("kivi2", "snapkv", "qevict"), budget=0.2, max_new=16))
    by_name = {lane["name"]: lane for lane in spec["lanes"]}
    assert "budget_bytes" not in by_name["kivi2"]  # KIVI has no budget to raise
    assert by_name["snapkv"]["budget_bytes"] > 0.2 * lanes[0].cache.shape.fullkv_bytes(input_ids.shape[1] + 16)
    assert "keeps at least 33 tokens per head" in by_name["snapkv"]["note"]


@pytest.mark.parametrize("reference", ["fullkv", "fullkv_static"])  # the static layout: a GPU's graphed lanes
def test_at_a_budget_that_holds_everything_qevict_is_fullkv(studio, reference):
    final = list(studio.run(request("Why is the sky blue?", (reference, "qevict"), budget=1.0, max_new=20)))[-1]
    fullkv, qevict = final.view.lanes.values()
    assert qevict.tokens == fullkv.tokens and qevict.total_bytes <= fullkv.total_bytes
    assert qevict.tiers["quantized"] == qevict.tiers["evicted"] == 0 and not final.view.routed_lanes()
    html = cards.lanes_html(final.view)
    assert "this lane is FullKV" in qevict.note and "✓ same tokens as FullKV" in html
    assert "the reference: nothing compressed" in html


def test_run_streams_persists_and_replays_identically(studio):
    updates = list(studio.run(request()))
    final = updates[-1]
    assert final.status == "done" and len(updates) >= 24
    view = final.view
    assert {name: len(lane.tokens) for name, lane in view.lanes.items()} == {"fullkv": 24, "snapkv": 24, "qevict": 24}
    assert view.routed_lanes() == ["qevict"]
    meta = studio.store.get(final.session_id)
    assert meta["status"] == "done" and meta["summary"]["lanes"]["qevict"]["tokens"] == 24
    replayed, last, _ = studio.replay(final.session_id)
    assert last == 23
    assert cards.lanes_html(replayed) == cards.lanes_html(view)
    assert cards.stats_table(replayed) == cards.stats_table(view)
    assert plots.bytes_plot(replayed).to_json() == plots.bytes_plot(view).to_json()
    for layer in range(3):
        assert plots.tier_map(replayed, "qevict", layer).to_json() == plots.tier_map(view, "qevict", layer).to_json()
        assert cards.prompt_html(replayed, "qevict", layer) == cards.prompt_html(view, "qevict", layer)
        assert cards.moves_html(replayed, "qevict", layer) == cards.moves_html(view, "qevict", layer)


def test_each_shown_step_is_already_stored_and_replays_the_same(studio):
    """What the viewer saw at step s is what the replay at step s shows (bytes included), and it was written
    before it was shown: a crash loses at most the step in flight."""
    stream = studio.run(request(max_new=12))
    next(stream)  # before prefill: nothing shown yet
    for update in stream:
        if update.status != "running":
            break
        step = update.view.step
        stored, _, _ = studio.replay(update.session_id, step=step)
        assert cards.lanes_html(stored) == cards.lanes_html(update.view)
        assert cards.stats_table(stored) == cards.stats_table(update.view)
        assert all(lane.total_bytes > 0 for lane in stored.lanes.values())


def test_interrupted_run_leaves_a_replayable_partial_session(studio):
    stream = studio.run(request(max_new=40))
    first = next(stream)
    for _ in range(12):
        next(stream)
    stream.close()  # the browser went away / the worker was cancelled mid-stream
    meta = studio.store.get(first.session_id)
    assert meta["status"] == "stopped"
    view, last, _ = studio.replay(first.session_id)
    assert [len(lane.tokens) for lane in view.lanes.values()] == [12, 12, 12] and last == 11


def test_a_run_closed_before_its_first_step_is_stopped_not_running(studio):
    stream = studio.run(request(max_new=40))
    first = next(stream)
    stream.close()
    assert studio.store.get(first.session_id)["status"] == "stopped"


def test_stop_flag_ends_the_run_and_keeps_the_text(studio):
    produced = []

    def stop_after_ten():
        return len(produced) >= 10

    for update in studio.run(request(max_new=60), stop_after_ten):
        produced.append(update)
    assert update.status == "stopped"
    assert all(lane.done == "stopped" for lane in update.view.lanes.values())
    assert studio.store.get(update.session_id)["status"] == "stopped"


def test_stop_before_a_queued_run_starts_keeps_it_from_starting():
    tabs = TabRuns()
    tabs.arm("tab")
    assert tabs.stop("tab") == "queued"
    assert tabs.start("tab") is None
    assert tabs.stop("tab") is None  # nothing left to stop
    tabs.arm("tab")
    flag = tabs.start("tab")
    assert flag is not None and not flag.is_set()
    tabs.arm("tab")  # Generate again while running: queued behind it
    assert tabs.stop("tab") == "running" and flag.is_set()
    tabs.finish("tab")
    assert tabs.start("tab") is None  # Stop ended the queued one too
    tabs.arm("tab")
    flag = tabs.start("tab")
    assert not flag.is_set()
    tabs.forget("tab")  # the tab closed while running
    assert flag.is_set()
    assert tabs.stop("other") is None
    assert not tabs.start("api").is_set()  # an API call is never armed: it gets its own fresh flag


def test_a_malformed_stored_row_is_a_message_on_its_own_page(studio):
    good = list(studio.run(request(max_new=4)))[-1].session_id
    bad = list(studio.run(request(max_new=4)))[-1].session_id
    with studio.store.engine.begin() as conn:
        conn.execute(sql_update(SessionRow).where(SessionRow.id == bad).values(
            request={"lanes": [{"name": 5, "method": "fullkv"}], "config": {"sinks": 5, "omega": 8}}))
        conn.execute(sql_update(EventRow).where(EventRow.session_id == good, EventRow.seq == 0).values(
            payload={"kind": "token", "lane": "fullkv", "step": "abc"}))
    garbled = list(studio.run(request(max_new=4)))[-1].session_id
    with studio.store.engine.begin() as conn:
        conn.execute(text("UPDATE sessions SET request = '{not json' WHERE id = :id"), {"id": garbled})
    for session_id in (good, bad, garbled):
        with pytest.raises(ValueError, match="stored in a form this studio cannot show"):
            studio.replay(session_id)
    assert "cannot show" in diagnostics_text(studio, bad)
    other = list(studio.run(request(max_new=4)))[-1].session_id
    assert studio.replay(other)[1] == 3  # the others still open
    owned = [{"id": i, "token": "t"} for i in (good, bad, garbled, other)]
    listed = sessions.rows(studio.store, owned)
    assert [row[0] for row in listed] == [other, garbled, bad, good]
    assert listed[1][3] == "(unreadable)"


def test_the_browser_list_drops_what_is_not_a_session_reference():
    state = [{"id": "abc", "token": "t1"}, {"id": 5, "token": "x"}, "junk", {"id": "a b", "token": "t"},
             {"id": "abc", "token": "dup"}, {"id": "def", "token": "t2", "extra": 1}]
    assert sessions.refs(state) == [{"id": "abc", "token": "t1"}, {"id": "def", "token": "t2"}]
    assert sessions.refs("not a list") == []
    assert sessions.add(state, "new", "tok")[0] == {"id": "new", "token": "tok"}
    assert sessions.remove(state, "abc") == [{"id": "def", "token": "t2"}]
    assert sessions.token_for(state, "def") == "t2" and sessions.token_for(state, "zzz") is None


def test_text_is_escaped_everywhere(studio):
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)> " * 20
    final = list(studio.run(request(evil, ("qevict",), max_new=4)))[-1]
    html = cards.prompt_html(final.view, "qevict", 1) + cards.lanes_html(final.view)
    assert "<script>" not in html and "<img" not in html and "&lt;script&gt;" in html


def test_the_prompt_view_shows_the_users_text_without_template_markup(studio):
    final = list(studio.run(request("Tell me about foxes.", ("fullkv",), max_new=2)))[-1]
    html = cards.prompt_html(final.view, None, 0)
    assert "Tell me about foxes." in html and "im_start" not in html and "assistant" not in html
    assert "The chat template adds" in html


def test_non_latin_text_is_shown_whole_in_the_prompt_view(studio):
    """Byte-level tokens split an emoji, a Hebrew or a Chinese character; the prompt view shows each character
    whole (on its first token), never a replacement character."""
    prompt = "Shalom שלום, nǐ hǎo 你好 👋 and a right-to-left mark \u200f here."
    final = list(studio.run(request(prompt, ("qevict",), max_new=4)))[-1]
    pieces = final.view.request["prompt_tokens"]
    start, stop = final.view.request["prompt_span"]
    assert "".join(pieces[start:stop]) == prompt and not any("\ufffd" in p for p in pieces)
    html = cards.prompt_html(final.view, "qevict", 1)
    assert "שלום" in html and "你好" in html and "👋" in html and "\ufffd" not in html


def test_a_character_split_over_generated_tokens_arrives_whole():
    """The token that starts a multi-byte character adds no text; the one that completes it adds the character."""
    from qevict_core.generation.generate import Lane, _lane_events

    tok = tiny_tokenizer()
    lane = Lane("q", make_cache("fullkv", tiny_model(), None, max_length=8))
    ids = tok("a👋", add_special_tokens=False).input_ids  # 'a' then the emoji's four bytes
    texts = [next(e for e in _lane_events(lane, i, t, 0.0, None, tok) if e.kind == "token").text
             for i, t in enumerate(ids)]
    assert texts == ["a", "", "", "", "👋"] and lane.text == "a👋"


def test_progress_says_where_the_run_is(studio):
    stream = studio.run(request(max_new=6))
    first = next(stream)
    assert progress_text(first).startswith("**Reading the prompt**") and "about" not in \
        progress_text(first)  # nothing of this run measured yet: no time shown
    texts = [progress_text(update) for update in stream]
    assert texts[0] == "**Generating…** token 1 of at most 6." and "left" not in texts[3]
    assert "left at this run's pace" in texts[4]  # four decode steps measured
    assert texts[-1] == "**Done.**"


def test_a_qevict_head_run_is_stored_replayed_and_diagnosed_per_head(studio):
    final = list(studio.run(request(methods=("fullkv", "qevict_head"), max_new=32)))[-1]
    view, _, _ = studio.replay(final.session_id, None)
    heads = {e.head for events in view.routing["qevict_head"].values() for e in events}
    assert heads == set(range(studio.num_kv_heads))
    assert view.layer_events("qevict_head", 0, 1) and all(e.head == 1
                                                          for e in view.layer_events("qevict_head", 0, 1))
    row = next(line for line in diagnostics_text(studio, final.session_id).splitlines()
               if line.startswith("| qevict_head |"))
    assert all(c.strip() for c in row.strip("|").split("|"))


def test_each_lane_is_drawn_with_the_configuration_it_ran_with(studio):
    """r1 (Ω = 1) and qevict_omega16 beside qevict (the form's Ω = 8): each lane stores the config its method ran
    with, and the tier map, heatmap and prompt colouring draw that lane's windows, live and replayed."""
    final = list(studio.run(request(methods=("qevict", "r1", "qevict_omega16"), max_new=32)))[-1]
    replayed, _, meta = studio.replay(final.session_id)
    stored = {lane["method"]: lane["config"] for lane in meta["request"]["lanes"]}
    assert {m: c["omega"] for m, c in stored.items()} == {"qevict": 8, "r1": 1, "qevict_omega16": 16}
    assert stored["r1"]["q_frac"] == 0.0 and stored["r1"]["coverage"] is None and stored["qevict"]["coverage"] == 0.7
    for view in (final.view, replayed):
        for lane, omega in (("qevict", 8), ("r1", 1), ("qevict_omega16", 16)):
            assert view.omega(lane) == omega
            events = view.layer_events(lane, 0)
            assert events, lane
            last = events[-1]
            windows = (last.seen - 1 - view.sinks(lane)) // omega + 1
            fig = plots.tier_map(view, lane, 0)
            assert len(fig.data[0].z) == windows and fig.layout.yaxis.title.text == f"window ({omega} tokens)"
            # every window the lane kept is drawn in its tier at the last event
            column = [row[-1] for row in fig.data[0].z]
            assert all(column[w] == plots.TIER_CODES["full"] for w in last.full if w < windows)
            assert all(column[w] == plots.TIER_CODES["quantized"] for w in last.quantized if w < windows)
            heat = plots.score_heatmap(view, lane)
            x, largest = list(heat.data[0].x), max(last.scores)
            width = x[1] - x[0] if len(x) > 1 else 1  # r1's ~1,400 windows are drawn two per column
            assert width == (1 if lane != "r1" else 2) and x[-1] <= largest < x[-1] + width
            # a column shows the largest score of its windows
            drawn = [v for v in heat.data[0].z[0] if v is not None]
            assert max(drawn) == round(max(v for v in last.scores.values() if v is not None), 3)
        # the prompt colouring groups tokens by each lane's own Ω: a window's tokens share its tier
        assert cards.prompt_html(view, "r1", 0) != cards.prompt_html(view, "qevict_omega16", 0)
    row = {line.split("|")[1].strip(): line for line in diagnostics_text(studio, final.session_id).splitlines()
           if line.startswith("| ")}
    assert {"qevict", "r1", "qevict_omega16"} <= set(row)


def test_a_session_exported_before_lane_configs_and_16_bit_caches_replays(studio):
    final = list(studio.run(request(methods=("fullkv", "qevict"), max_new=16)))[-1]
    doc = json.loads(json.dumps(studio.store.export(final.session_id)))
    doc["format"] = "qevict-session/1"  # as an earlier version exported it:
    doc["session"]["request"]["config"].pop("kv_dtype")  # no kv_dtype,
    for lane in doc["session"]["request"]["lanes"]:
        lane.pop("config")  # no lane configs,
        if lane["method"] == "qevict":
            lane["method"] = "qevict_cover"  # and a method since removed
    new_id, _ = studio.store.import_session(json.dumps(doc))
    view, _, _ = studio.replay(new_id)
    # the retired name reads as the method it became with the changes it stood for, over the session's form
    assert view.config("qevict")["coverage"] == 0.7 and view.config("qevict")["bits"] == 4
    assert view.config("qevict")["kv_dtype"] == "model" and view.omega("qevict") == SETTINGS["omega"]
    assert plots.tier_map(view, "qevict", 0).data[0].z
    with pytest.raises(ValueError, match="allowed"):
        parse_request(Controls.lanes(["qevict_pool"], prompt="hi", **SETTINGS, max_new_tokens=4))


def test_a_window_id_beyond_the_run_is_refused_and_every_drawing_is_bounded(studio):
    final = list(studio.run(request(methods=("fullkv", "qevict"), max_new=16)))[-1]
    doc = studio.store.export(final.session_id)
    routing = next(e for e in doc["events"] if e["kind"] == "routing")
    routing["scores"]["299999"] = 0.5  # a valid-looking key far past the session's 16 + prompt tokens
    with pytest.raises(ValueError, match=r"names window 299999; this lane's windows are 0\.\.\d+"):
        studio.store.import_session(json.dumps(doc))
    routing["scores"].pop("299999")
    routing["seen"] = 10**6
    with pytest.raises(ValueError, match="recent_start <= seen <="):
        studio.store.import_session(json.dumps(doc))
    # The largest run the schema admits at Ω = 1 is drawn within the bounds, its axes saying how.
    windows, steps = 20_000, 512
    view = RunView({"lanes": [{"name": "r", "method": "r1", "config": {"sinks": 0, "omega": 1}}], "config": {"sinks": 0, "omega": 1},
                    "sampling": {"max_new_tokens": steps}, "prompt_tokens": ["a"] * (windows - steps)})
    for step in range(steps):
        feed(view, {"kind": "routing", "lane": "r", "step": step, "layer": 0, "seen": windows - steps + step + 1,
                    "recent_start": windows - steps + step - 31, "full": list(range(0, 2000, 3)),
                    "quantized": [], "promoted": [step], "demoted": [], "evicted": [],
                    "scores": {str(w): float(w % 7) for w in range(0, windows, 97)}})
    fig = plots.tier_map(view, "r", 0)
    cells = len(fig.data[0].z) * len(fig.data[0].z[0])
    assert cells <= plots.MAX_CELLS and len(fig.data[0].z[0]) == plots.MAX_EVENTS_DRAWN
    assert fig.layout.yaxis.title.text.startswith("every ") and list(fig.data[0].y)[1] > 1
    heat = plots.score_heatmap(view, "r")
    assert len(heat.data[0].z[0]) <= plots.MAX_WINDOWS_DRAWN and "largest of" in heat.layout.xaxis.title.text
    assert len(fig.to_json()) < 3 * 2**20


