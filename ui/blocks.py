"""The studio's Blocks: components and wiring only. What each event does is a plain method of a tab's handlers
(``run_tab``, ``replay_tab``, ``sessions_tab``), wired by name (``named.wire``): a handler's parameters and
returned fields are the components of the same names here. The form's schema is ``form``, drawing is ``plots``
and ``cards``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import gradio as gr

from qevict_core.registry import METHODS
from storage.schema import max_import_bytes

from . import sessions
from .components import FormCheckbox, FormDropdown, FormNumber, FormRadio, FormSlider, FormTextbox
from .control import TabRuns
from .examples import EXAMPLES
from .form import MAX_NEW_TOKENS, Controls, api_schema
from .named import wire
from .replay_tab import ReplayHandlers
from .run_tab import RunHandlers, lane_choices
from .sessions_tab import SessionHandlers
from .glossary import GLOSSARY
from .studio import Studio

DEFAULTS = Controls()  # what the form opens with
PRESENT_JS = "(on) => { document.body.classList.toggle('qe-present', on === true); }"
INTRO = """# QEvict studio
Run one prompt through up to three KV caches side by side at the **same byte budget**: the uncompressed cache
(FullKV), a baseline and QEvict, which keeps most windows of past tokens in 4 bits that still take part in
attention and can be promoted back, the most-attended ones in full precision when the bytes allow, and evicts the
rest. Pick an example and press **Generate**. Every run is saved; its share link replays it step by step."""


def methods_markdown() -> str:
    rows = [f"| `{name}` | {spec.description} | {spec.reference} |" for name, spec in METHODS.items()
            if spec.kind == "method"]
    ablations = [f"| `{name}` | {spec.description} |" for name, spec in METHODS.items() if spec.kind == "ablation"]
    return ("| method | keeps | follows |\n|---|---|---|\n" + "\n".join(rows)
            + "\n\n**Ablations** (in the lane menus once *Show ablations* is ticked):\n\n| ablation | keeps |\n"
              "|---|---|\n" + "\n".join(ablations))


def view_panel(prefix: str, layers: int, heads: int, present: gr.Checkbox) -> SimpleNamespace:
    """What a run looks like, live (Run tab) or replayed: lanes, stats, bytes, pickers, routing views. Each
    drawing's attribute is its field of ``outputs.ViewOutputs``; the pickers' are those of ``outputs.Shown``
    (``present``, the page's presentation-mode box, is every view's)."""
    p = SimpleNamespace(present=present)
    p.lanes = gr.HTML(elem_id=f"{prefix}lanes")
    p.stats = gr.Dataframe(headers=["measure"], interactive=False, elem_id=f"{prefix}stats", wrap=True,
                           max_height=440, column_widths=["34%"],
                           label="Lanes side by side (tokens per layer, moves in windows; see the glossary)")
    p.memory = gr.Plot(label="Bytes per tier", show_label=False, elem_id=f"{prefix}bytes")
    with gr.Row():
        p.shown_lane = FormDropdown([], value=None, label="Routing shown for lane", elem_id=f"{prefix}shown-lane",
                             allow_custom_value=True, scale=2, min_width=160).declare(api_schema("shown_lane"))
        p.layer = FormSlider(0, layers - 1, value=layers // 2, step=1, label=f"Layer (0–{layers - 1})",
                             elem_id=f"{prefix}layer", scale=3, min_width=160).declare(
                                 {**api_schema("layer"), "maximum": layers - 1})
        p.head = FormSlider(0, heads - 1, value=0, step=1, elem_id=f"{prefix}head", scale=2, min_width=160,
                            label=f"KV head, for a lane routed per head (0–{heads - 1})").declare(
                                {**api_schema("head"), "maximum": heads - 1})
    with gr.Row(equal_height=False, elem_classes="qe-routing"):
        p.tier = gr.Plot(label="Tier map", show_label=False, elem_id=f"{prefix}tier-map", min_width=320)
        p.heat = gr.Plot(label="Cumulative scores", show_label=False, elem_id=f"{prefix}heatmap", min_width=320)
    p.moves = gr.HTML(elem_id=f"{prefix}moves")
    p.prompt = gr.HTML(elem_id=f"{prefix}prompt-tiers")
    return p


def run_tab(studio: Studio, present: gr.Checkbox) -> SimpleNamespace:
    t = SimpleNamespace()
    with gr.Row():
        with gr.Column(scale=3, min_width=300):
            t.example = gr.Dropdown(list(EXAMPLES), value=None, label="Example prompts", elem_id="example")
            t.hint = gr.Markdown(elem_id="example-hint")
            t.prompt = FormTextbox(lines=6, max_lines=14, label="Prompt", elem_id="prompt").declare(
                api_schema("prompt"))
            t.expected = FormTextbox("", label="Expected answer (optional: each lane is checked for it)",
                                     elem_id="expected", max_length=200).declare(api_schema("expected"))
        with gr.Column(scale=2, min_width=300):
            with gr.Row():
                t.lanes = [FormDropdown(lane_choices(False), value=value, label=f"Lane {i}",
                                        elem_id=f"lane{i}").declare(api_schema("lane"))
                           for i, value in enumerate((DEFAULTS.lane1, DEFAULTS.lane2, DEFAULTS.lane3), start=1)]
                t.lane1, t.lane2, t.lane3 = t.lanes
            t.ablations = gr.Checkbox(False, label="Show ablations (R1, R2, no promotion, scorers, Ω, per-head "
                                      "routing, …) in the lane menus", elem_id="ablations")
            t.budget = FormSlider(0.01, 1.0, value=DEFAULTS.budget, step=0.01, elem_id="budget",
                                  label="KV budget: share of FullKV's bytes (0.01–1)").declare(api_schema("budget"))
            t.max_new_tokens = FormSlider(1, MAX_NEW_TOKENS, value=DEFAULTS.max_new_tokens, step=1, elem_id="max-new",
                                   label=f"Max new tokens (1–{MAX_NEW_TOKENS})").declare(api_schema("max_new_tokens"))
            with gr.Accordion("QEvict settings", open=False, elem_classes="qe-aside"):
                with gr.Row():
                    t.omega = FormSlider(1, 64, value=DEFAULTS.omega, step=1,
                                         label="Ω: window and routing interval, tokens (1–64)").declare(
                                             api_schema("omega"))
                    t.q_frac = FormSlider(0.0, 1.0, value=DEFAULTS.q_frac, step=0.05,
                                          label="q: share of the history budget in low bits (0–1)").declare(
                                              api_schema("q_frac"))
                    t.coverage = FormSlider(0.0, 1.0, value=DEFAULTS.coverage, step=0.05, elem_id="coverage",
                                            label="coverage κ: share of the windows the low-bit tier is sized for "
                                                  "first (0 = split by q)").declare(api_schema("coverage"))
                with gr.Row():
                    t.bits = FormRadio([2, 4], value=DEFAULTS.bits, label="low-bit tier: bits").declare(
                        api_schema("bits"))
                    t.scorer = FormDropdown(list(studio.choices["scorers"]), value=DEFAULTS.scorer,
                                            label="scorer").declare(
                        api_schema("scorer"))
                    t.promotion = FormCheckbox(value=DEFAULTS.promotion, label="promotion").declare(
                        api_schema("promotion"))
                with gr.Row():
                    # No minimum/maximum here: Gradio would refuse before our form could say why.
                    t.sinks = FormNumber(value=DEFAULTS.sinks, label="sinks (0–64)").declare(api_schema("sinks"))
                    t.recent = FormNumber(value=DEFAULTS.recent, label="recent (0–1024)").declare(
                        api_schema("recent"))
                    t.temperature = FormNumber(value=DEFAULTS.temperature, label="temperature (0 = greedy, up to 2)"
                                               ).declare(api_schema("temperature"))
                    t.seed = FormNumber(value=DEFAULTS.seed, label="seed (0 or more)").declare(api_schema("seed"))
    with gr.Row():
        t.generate = gr.Button("Generate", variant="primary", elem_id="generate")
        t.stop = gr.Button("Stop", elem_id="stop")
    t.status = gr.Markdown(elem_id="status")
    t.view = view_panel("", studio.num_layers, studio.num_kv_heads, present)
    t.share = gr.Markdown(elem_id="share")
    with gr.Accordion("What each method keeps", open=False, elem_classes="qe-aside"):
        gr.Markdown(methods_markdown(), elem_id="methods")
    with gr.Accordion("Glossary: tiers, columns, diagnostics", open=False, elem_classes="qe-aside"):
        gr.Markdown(GLOSSARY, elem_id="glossary")
    return t


def replay_tab(studio: Studio, present: gr.Checkbox) -> SimpleNamespace:
    r = SimpleNamespace()
    with gr.Row():
        r.id = gr.Textbox(label="Session id", elem_id="replay-id", scale=3)
        r.load = gr.Button("Load", elem_id="replay-load", scale=1)
    r.status = gr.Markdown(elem_id="replay-status")
    with gr.Row():
        r.step = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="replay-step", scale=4)
        r.play = gr.Button("Play", elem_id="replay-play", scale=1, min_width=80)
        r.pause = gr.Button("Pause", elem_id="replay-pause", scale=1, min_width=80)
    r.timer = gr.Timer(0.4, active=False)
    r.view = view_panel("replay-", studio.num_layers, studio.num_kv_heads, present)
    r.diagnose = gr.Button("Diagnostics against FullKV attention", elem_id="replay-diagnose")
    r.diagnostics = gr.Markdown(elem_id="replay-diagnostics")
    r.time = gr.Button("Time the lanes alone (interleaved, as bench.tpot)", elem_id="replay-time")
    r.timing = gr.Markdown(elem_id="replay-timing")
    with gr.Accordion("Glossary: tiers, columns, diagnostics", open=False, elem_classes="qe-aside"):
        gr.Markdown(GLOSSARY)
    return r


def sessions_tab() -> SimpleNamespace:
    s = SimpleNamespace()
    gr.Markdown("Runs made or imported **in this browser** (kept in its local storage, with their delete tokens). "
                "Nobody else sees this list; a share link opens one run.")
    s.table = gr.Dataframe(headers=sessions.SESSION_HEADERS, interactive=False, elem_id="sessions-table", wrap=True,
                           label="Loading this browser's runs…", show_label=True)
    s.id = gr.Textbox(label="Session id (click a row)", elem_id="manage-id")
    with gr.Row():
        s.open = gr.Button("Open in Replay", elem_id="open-session")
        s.export = gr.Button("Export JSON", elem_id="export-session")
        s.delete = gr.Button("Delete", variant="stop", elem_id="delete-session")
        s.confirm = gr.Button("Confirm delete", variant="stop", elem_id="confirm-delete", visible=False)
    with gr.Accordion("Delete a session made in another browser", open=False):
        s.token = gr.Textbox(label="Delete token", type="password", elem_id="manage-token")
    s.file = gr.File(label="Exported session", elem_id="export-file", interactive=False, visible=False)
    s.upload = gr.File(label=f"Import a session (.json, up to {max_import_bytes() / 2**20:.0f} MiB)",
                       file_types=[".json"], elem_id="import-file")
    s.status = gr.Markdown(elem_id="manage-status")
    return s


def build_demo(studio: Studio) -> gr.Blocks:
    tabs_state = TabRuns()
    run, replay = RunHandlers(studio, tabs_state), ReplayHandlers(studio, tabs_state)
    saved = SessionHandlers(replay)
    private = {"api_visibility": "private"}
    with gr.Blocks(title="QEvict studio", analytics_enabled=False) as demo:
        owned = gr.BrowserState([], storage_key=sessions.STORAGE_KEY,
                                # The secret travels to the browser with the page, so it protects nothing; a fixed
                                # one keeps a visitor's list readable across server restarts.
                                secret=os.environ.get("QEVICT_BROWSER_SECRET", "qevict-studio"))
        # what the tab has typed: a reload or a server restart gives it back
        draft = gr.BrowserState(None, storage_key="qevict-draft",
                                secret=os.environ.get("QEVICT_BROWSER_SECRET", "qevict-studio"))
        gr.Markdown(INTRO, elem_id="intro")
        present = gr.Checkbox(False, label="Presentation mode: large type, one lane's routing in focus (a link with "
                              "&present=1 opens in it)", elem_id="present", container=False)
        with gr.Tabs(selected="run") as tabs:
            with gr.Tab("Run", id="run"):
                t = run_tab(studio, present)
            with gr.Tab("Replay", id="replay"):
                r = replay_tab(studio, present)
            with gr.Tab("Sessions", id="sessions") as sessions_page:
                s = sessions_tab()
        v, rv = t.view, r.view
        new_ref = gr.State(None)  # the run's {id, token}, handed to the browser's list (not part of the API)

        # -- run: the form's controls by their names, the view's pickers and drawings as groups
        on = {**vars(t), "controls": t, "shown": v, "layer": v.layer, "ref": new_ref, "owned": owned,
              "draft": draft}
        draft_fields = [t.prompt, t.expected, t.max_new_tokens]
        wire(t.example.change, run.pick_example, on, **private).then(
            run.save_draft, draft_fields, draft, **private)
        wire(t.prompt.input, run.prompt_edited, on, **private)
        wire(t.ablations.change, run.show_ablations, on, t.lanes, **private)
        wire(_on([*(menu.change for menu in t.lanes), demo.load]), run.shown_lane_menu, on, v.shown_lane, **private)
        wire(t.generate.click, run.arm, on, queue=False, **private).then(
            *wire(_unbound, run.generate, on), api_name="generate", concurrency_id="gpu", concurrency_limit=1,
            show_progress_on=[t.status])
        wire(new_ref.change, run.record, on, owned, **private)
        wire(_on([t.prompt.blur, t.expected.blur, t.max_new_tokens.release, t.generate.click]), run.save_draft, on,
             draft, **private)
        wire(demo.load, run.restore_draft, on, **private)
        wire(t.stop.click, run.request_stop, on, t.status, queue=False, **private)
        # presentation mode: the page's type by a class on the body, the figures redrawn at their large size
        present.change(None, present, None, js=PRESENT_JS, **private)
        wire(_on([v.layer.change, v.head.change, v.shown_lane.change, present.change]), run.redraw_routing,
             {**vars(v), "shown": v}, **private)

        # -- replay
        replayed = SimpleNamespace(status=r.status, step=r.step, shown_lane=rv.shown_lane, view=rv)
        on = {**vars(replayed), "session_id": r.id, "shown": rv, "timer": r.timer}
        wire(r.load.click, replay.load_replay, on, **private)
        # always_last: a dragged step slider ends on the step it was let go at, not the first one it passed
        wire(_on([r.step.input, rv.layer.change, rv.head.change, rv.shown_lane.input, present.change]),
             replay.redraw, on, trigger_mode="always_last", **private)
        wire(r.play.click, replay.play, on, r.timer, **private)
        wire(r.pause.click, replay.pause, on, r.timer, **private)
        wire(r.timer.tick, replay.tick, on, **private)
        wire(r.diagnose.click, replay.run_diagnostics, on, r.diagnostics, concurrency_id="gpu", concurrency_limit=1,
             **private)
        wire(r.time.click, replay.time_lanes, on, r.timing, concurrency_id="gpu", concurrency_limit=1, **private)

        # -- sessions, deep links and cleanup
        on = {"owned": owned, "session_id": s.id, "token": s.token, "upload": s.upload, "shown": rv, "tabs": tabs,
              "replay_id": r.id, "replay": replayed, "table": s.table, "present": present}
        wire(_on([owned.change, sessions_page.select]), saved.list_sessions, on, s.table, **private)
        wire(s.table.select, saved.pick_row, on, s.id, **private)
        wire(s.open.click, saved.open_session, on, **private)
        wire(s.export.click, saved.export_session, on, [s.file, s.status], **private)
        wire(_on([s.upload.upload, s.upload.clear]), saved.import_session, on, [s.status, owned], **private)
        wire(s.delete.click, saved.ask_delete, on, [s.confirm, s.status], **private)
        wire(s.confirm.click, saved.delete_session, on, [s.status, owned, s.confirm], **private)
        s.id.change(lambda: gr.update(visible=False), None, s.confirm, **private)  # a confirm is for one id
        wire(demo.load, saved.on_load, on, **private)
        demo.unload(run.forget)
    return demo


def _on(triggers: list):
    """A listener for several triggers (``gr.on``), as ``wire`` calls one."""
    return lambda fn, inputs, outputs, **kwargs: gr.on(triggers, fn, inputs, outputs, **kwargs)


def _unbound(fn, inputs, outputs):
    """What ``wire`` made, unregistered: (fn, inputs, outputs) for a ``.then`` that takes them positionally."""
    return fn, inputs, outputs
