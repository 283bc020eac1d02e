"""Each tab's handlers (``run_tab``, ``replay_tab``, ``sessions_tab``), called as their controls call them, and the
wiring by name (``ui/named.py``): a handler's parameters and returned fields reach the components of their names."""

import json

import gradio as gr
import pytest

from qevict_core import QEvictConfig
from storage import SessionStore, make_engine
from tests.conftest import tiny_chat_model, tiny_tokenizer
from tests.studio_calls import diagnostics_text, request
from ui.control import TabRuns
from ui.examples import EXAMPLES
from ui.form import Controls
from ui.named import Outputs, keep, wire
from ui.outputs import At, ReplayOutputs, Shown, ViewOutputs
from ui.replay_tab import ReplayHandlers
from ui.run_tab import BOOT, RunHandlers, pick_lane
from ui.sessions_tab import SessionHandlers
from ui.studio import Studio
from ui.texts import timing_markdown


@pytest.fixture(scope="module")
def studio():
    return Studio(tiny_chat_model(), tiny_tokenizer(), SessionStore(make_engine("sqlite://")), "tiny")


def test_diagnostics_of_a_stored_run(studio):
    final = list(studio.run(request(methods=("fullkv", "qevict"), max_new=32)))[-1]
    table = diagnostics_text(studio, final.session_id)
    row = next(line for line in table.splitlines() if line.startswith("| qevict |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert len(cells) == 9 and all(c != "" for c in cells)
    fmm, fmm_fp = float(cells[0]), float(cells[1])
    assert 0 <= fmm <= fmm_fp <= 1
    assert "No such session" in diagnostics_text(studio, "nope")


def test_the_lane_picker_chooses_whose_routing_is_drawn(studio):
    events = RunHandlers(studio, TabRuns())
    menu = events.shown_lane_menu("fullkv", "qevict", "qevict_head")
    assert menu["choices"] == ["qevict", "qevict_head"] and menu["value"] == "qevict"
    assert events.shown_lane_menu("qevict", "(none)", "qevict")["choices"] == ["qevict", "qevict#2"]
    assert events.shown_lane_menu("fullkv", "snapkv", "(none)")["choices"] == []
    final = list(studio.run(request(methods=("fullkv", "qevict", "qevict_head"), max_new=16)))[-1]
    for lane in ("qevict", "qevict_head"):
        drawn = ViewOutputs.routing(final.view, At(0, 1, pick_lane(final.view, lane)))
        tier, heat = drawn.tier, drawn.heat
        assert tier.layout.title.text.startswith(f"{lane}: layer 0") and heat.layout.title.text.startswith(lane)
    # the picked head reaches the per-head lane only; an unknown lane falls back to the first QEvict lane
    at = RunHandlers(studio, TabRuns()).pickers.at
    assert "KV head 1" in ViewOutputs.routing(final.view, at(Shown(0, 1, "qevict_head"), final.view)).tier.layout.title.text
    assert ViewOutputs.routing(final.view, at(Shown(0, 1, "nope"), final.view)).tier.layout.title.text.startswith(
        "qevict: layer 0")
    # the replay handler offers the run's routed lanes and draws the one asked for
    out = ReplayHandlers(studio, TabRuns()).show_replay(final.session_id, None, Shown(0, 1, "qevict_head"))
    assert out.shown_lane["choices"] == ["qevict", "qevict_head"] and out.shown_lane["value"] == "qevict_head"
    assert out.view.tier.layout.title.text.startswith("qevict_head: layer 0, KV head 1")



def test_presentation_mode_draws_the_routing_large_and_a_non_boolean_is_refused(studio):
    from ui.plots import LARGE

    final = list(studio.run(request(methods=("fullkv", "qevict"), max_new=16)))[-1]
    at = RunHandlers(studio, TabRuns()).pickers.at
    normal, large = (ViewOutputs.routing(final.view, at(Shown(0, 0, "qevict", present), final.view))
                     for present in (False, True))
    for figure in ("tier", "heat"):
        small, big = getattr(normal, figure).layout, getattr(large, figure).layout
        assert big.title.font.size == round(small.title.font.size * LARGE) and big.height > small.height
    promoted = [t for t in large.tier.data if t.name == "promoted ▲"][0]
    assert promoted.marker.size == round(13 * LARGE)  # the marks grow with the type
    refused = list(RunHandlers(studio, TabRuns()).generate(
        Controls.lanes(["qevict"], prompt="hi", max_new_tokens=2), Shown(present="yes")))
    assert refused[-1].status.startswith("**Cannot run:** present: must be true or false (got 'yes')")


def test_a_redraw_without_a_loaded_replay_touches_nothing(studio):
    replay = ReplayHandlers(studio, TabRuns())
    assert replay.redraw("", 3, Shown(present=True)).values() == ReplayOutputs().values()
    assert replay.redraw("nope", None, Shown()).status.startswith("**No such session")


def test_a_share_link_asks_for_presentation_mode(studio):
    class Request:
        def __init__(self, query):
            self.query_params, self.session_hash = query, "tab"

    saved = SessionHandlers(ReplayHandlers(studio, TabRuns()))
    assert saved.on_load(Shown(), [], Request({"present": "1"})).present is True
    assert saved.on_load(Shown(), [], Request({})).present == gr.skip()


def test_a_draft_survives_a_reload_and_a_restart_says_so(studio):
    events = RunHandlers(studio, TabRuns())
    draft = events.save_draft("What did Mr. Darcy say?", "nothing", 100)
    assert draft == {"prompt": "What did Mr. Darcy say?", "expected": "nothing", "max_new": 100, "boot": BOOT}
    owned = [{"id": "a" * 22, "token": "t" * 22}]
    prompt, expected, max_new, status = events.restore_draft(draft, owned).values()  # a reload: the form back, no message
    assert (prompt, expected, max_new) == ("What did Mr. Darcy say?", "nothing", 100)
    assert status["__type__"] == "update"
    prompt, expected, _, status = events.restore_draft({**draft, "boot": "an-earlier-server"}, owned).values()
    assert prompt == "What did Mr. Darcy say?" and "**The server restarted.**" in status and "a" * 22 in status
    # what a browser sends back is untrusted: anything else restores nothing
    for bad in (None, [], {"prompt": 5}, {"prompt": ""}, "x"):
        assert all(out["__type__"] == "update" for out in events.restore_draft(bad, owned).values())
    assert events.restore_draft({"prompt": "hi", "max_new": 10**9, "boot": BOOT}, owned).max_new_tokens["__type__"] == "update"
    assert events.save_draft(["a list"], "", 64)["__type__"] == "update"


def test_an_example_s_answer_goes_when_its_prompt_is_edited(studio):
    events = RunHandlers(studio, TabRuns())
    name = next(iter(EXAMPLES))
    example = EXAMPLES[name]()
    assert all(out["__type__"] == "update" for out in events.prompt_edited(example.prompt, name).values())  # unchanged
    expected, picked, hint = events.prompt_edited(example.prompt + " And who wrote it?", name).values()
    assert (expected, picked, hint) == ("", None, "")
    assert all(out["__type__"] == "update" for out in events.prompt_edited("my own prompt", None).values())


def test_time_the_lanes_alone_rebuilds_the_runs_lanes_and_times_them_interleaved(studio):
    final = list(studio.run(request(methods=("fullkv", "qevict", "qevict"), max_new=8)))[-1]
    table = timing_markdown(studio.time_lanes(final.session_id, new_tokens=5))
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"lane", "fullkv", "qevict", "qevict#2"}
    assert rows["fullkv"].rstrip(" |").endswith("1.000")  # the baseline against itself, within the run
    assert "4 decode steps of every lane, interleaved" in table
    assert ReplayHandlers(studio, TabRuns()).time_lanes("no-such-session").startswith("**Cannot time this run:**")


def test_the_timing_baseline_is_fullkv_in_either_layout_wherever_its_lane_is(studio):
    final = list(studio.run(request(methods=("qevict", "fullkv_static"), max_new=8)))[-1]
    timing = studio.time_lanes(final.session_id, new_tokens=5)
    assert timing.baseline == "fullkv_static"


def test_the_promotion_example_sets_its_budget_and_a_layer_this_model_has(studio):
    from ui.examples import PROMOTION
    found = json.loads(PROMOTION.read_text())
    out = RunHandlers(studio, TabRuns()).pick_example("A window demoted, then promoted back")
    expected, new, layer, hint, budget = out.expected, out.max_new_tokens, out.layer, out.hint, out.budget
    assert (expected, new, budget) == (found["value"], found["max_new_tokens"], found["budget"])
    assert found["budget"] > QEvictConfig().budget  # where the default keeps full windows, so one can come back
    assert layer == min(found["layer"], studio.num_layers - 1) and f"{found['budget']:.0%} of the bytes" in hint
    needle = RunHandlers(studio, TabRuns()).pick_example("Needle in ~2K tokens of Austen (retrieval)")
    assert not isinstance(needle.layer, int)  # no layer of its own: the form's stays
    # but its settings are its own: picked after the promotion example, the needle runs at the default budget, greedy
    assert (needle.budget, needle.temperature, needle.seed) == (QEvictConfig().budget, 0.0, 0)
    drift = RunHandlers(studio, TabRuns()).pick_example("Long continuation (256 tokens)")
    assert drift.temperature > 0 and drift.max_new_tokens == 256  # sampled: greedy, SmolLM2 loops


def test_the_sessions_table_says_how_many_runs_it_lists(studio):
    events = SessionHandlers(ReplayHandlers(studio, TabRuns()))
    empty = events.list_sessions([])
    assert empty["value"] == [] and empty["label"] == "No runs saved in this browser yet"
    final = list(studio.run(request(methods=("qevict",), max_new=4)))[-1]
    listed = events.list_sessions([{"id": final.session_id, "token": "t"}, {"id": "not-a-session-id-at-all", "token": "t"}])
    assert [row[0] for row in listed["value"]] == [final.session_id] and listed["label"] == "1 run saved in this browser"


def test_wire_passes_components_by_name_and_returns_fields_in_their_order():
    from dataclasses import dataclass

    @dataclass
    class Panel(Outputs):
        tier: object = keep()
        moves: object = keep()

    @dataclass
    class Answer(Outputs):
        status: object = keep()
        panel: Panel = None

    @dataclass
    class Pickers:
        layer: object = 0
        head: object = 0
        shown_lane: object = None

    seen = {}

    def handler(session_id: str, shown: Pickers, request: gr.Request) -> Answer:
        seen.update(session_id=session_id, shown=shown, request=request)
        return Answer(status="ok", panel=Panel(moves="m"))

    group = type("Group", (), {"layer": "L", "head": "H", "shown_lane": "S", "tier": "T", "moves": "M"})
    wired = {}
    wire(lambda fn, inputs, outputs: wired.update(fn=fn, inputs=inputs, outputs=outputs), handler,
         {"session_id": "ID", "shown": group, "status": "ST", "panel": group})
    assert wired["inputs"] == ["ID", "L", "H", "S"] and wired["outputs"] == ["ST", "T", "M"]
    out = wired["fn"]("abc", 2, 1, "qevict", "the request")  # as Gradio calls it: inputs, then its request
    assert seen == {"session_id": "abc", "shown": Pickers(2, 1, "qevict"), "request": "the request"}
    assert out[0] == "ok" and out[1] == gr.skip() and out[2] == "m"  # a field left unset keeps its component
    with pytest.raises(KeyError, match="no component named 'panel'"):
        wire(lambda *a: None, handler, {"session_id": "ID", "shown": group, "status": "ST"})


def test_the_studio_wires_each_name_to_its_component():
    """On the built page: a share link's session id lands in the Replay tab's box, Generate's outputs are the
    status, the view's panels in ViewOutputs' order and the share line, and every panel has its component."""
    import app

    demo = app.create_demo(tiny_chat_model(), tiny_tokenizer(), database_url="sqlite://", model_name="tiny")
    by_fn = {}
    for dep in demo.fns.values():
        if dep.fn is not None:  # not a listener that runs in the browser alone (presentation mode's class)
            by_fn.setdefault(dep.fn.__name__, dep)
    ids = lambda dep: [getattr(block, "elem_id", None) for block in dep.outputs]  # noqa: E731
    load = ids(by_fn["on_load"])
    assert load[1] == "replay-id" and load[2] == "replay-status" and load[-2:] == ["sessions-table", "present"]
    panels = [f"{name}" for name in ("lanes", "stats", "bytes", "tier-map", "heatmap", "moves", "prompt-tiers")]
    assert ids(by_fn["generate"])[:9] == ["status", *panels, "share"]
    assert [name for (name,) in ViewOutputs.names()] == ["lanes", "stats", "memory", "tier", "heat", "moves", "prompt"]


def test_a_tick_already_sent_when_pause_is_pressed_draws_no_further_step(studio):
    class Request:
        session_hash = "tab"

    final = list(studio.run(request(methods=("qevict",), max_new=4)))[-1]
    replay = ReplayHandlers(studio, TabRuns())
    replay.load_replay(final.session_id, Shown(), Request())
    moved = replay.tick(final.session_id, 0, Shown(), Request())
    assert moved.step["value"] == 1 and moved.timer.active
    replay.pause(Request())
    paused = replay.tick(final.session_id, 1, Shown(), Request())
    assert paused.timer.active is False and paused.step == gr.skip()  # the step stays where Pause found it
    replay.play(Request())
    assert replay.tick(final.session_id, 1, Shown(), Request()).step["value"] == 2


def test_the_download_box_appears_only_with_an_exported_file_in_it(studio):
    final = list(studio.run(request(methods=("fullkv",), max_new=2)))[-1]
    saved = SessionHandlers(ReplayHandlers(studio, TabRuns()))
    box, status = saved.export_session(final.session_id)
    assert box["visible"] is True and json.load(open(box["value"]))["session"]["id"] == final.session_id
    assert status.startswith("Exported")
    box, status = saved.export_session("no-such-id")
    assert box["visible"] is False and box["value"] is None and status.startswith("**No such session")
