"""The studio's Blocks: wiring only. Logic lives in ``handlers``, drawing in ``plots``, state in ``view``."""

from __future__ import annotations

import json
import os
import tempfile
import threading

import gradio as gr

from qevict_core import QEvictConfig
from qevict_core.registry import METHODS

from . import plots
from .examples import EXAMPLES
from .gpu import GPU
from .handlers import NO_LANE, Studio, diagnose_session, parse_request
from .view import RunView

DEFAULTS = QEvictConfig()
INTRO = """# QEvict studio
Run one prompt through up to three KV caches side by side at the **same byte budget**: the uncompressed cache, a
baseline and QEvict, which keeps important windows in full precision, a broad middle in INT2 that can be promoted
back, and evicts the rest. Every run is saved and can be replayed or shared by link."""
THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "monospace"])


def methods_markdown() -> str:
    rows = [f"| `{name}` | {spec.description} | {spec.reference} |" for name, spec in METHODS.items()]
    return "| method | keeps | follows |\n|---|---|---|\n" + "\n".join(rows)


def map_lane(view: RunView | None) -> str | None:
    """The lane whose routing the tier map shows: the first QEvict-family lane that has routed."""
    if view is None:
        return None
    routed = view.routed_lanes()
    return next((n for n in routed if METHODS[view.lanes[n].method].family == "qevict"), routed[0] if routed else None)


def routing_outputs(view: RunView | None, layer: int) -> tuple:
    lane = map_lane(view)
    if view is None:
        return plots.empty_figure("No run yet."), plots.empty_figure("No run yet."), ""
    return plots.tier_map(view, lane, layer), plots.score_heatmap(view, lane), plots.prompt_html(view, lane, layer)


def share_markdown(session_id: str, token: str, request: gr.Request | None) -> str:
    host = os.environ.get("SPACE_HOST")
    base = f"https://{host}" if host else (f"http://{request.headers.get('host')}" if request is not None else "")
    link = f"{base}/?session={session_id}"
    return (f"**Share this run:** [{link}]({link})  \nDelete token (shown once, keep it to delete the session): "
            f"`{token}`")


def view_panel(prefix: str, layers: int) -> tuple:
    """What a run looks like, live (Run tab) or replayed: lanes, stats, layer picker, tier map, scores, prompt."""
    lanes = gr.HTML(elem_id=f"{prefix}lanes")
    stats = gr.Dataframe(headers=plots.STATS_HEADERS, interactive=False, elem_id=f"{prefix}stats")
    layer = gr.Slider(0, layers - 1, value=layers // 2, step=1, label="Layer shown in the tier map",
                      elem_id=f"{prefix}layer")
    with gr.Row():
        tier = gr.Plot(label="Tier map", elem_id=f"{prefix}tier-map")
        heat = gr.Plot(label="Cumulative scores", elem_id=f"{prefix}heatmap")
    prompt = gr.HTML(elem_id=f"{prefix}prompt-tiers")
    return lanes, stats, layer, tier, heat, prompt


def build_demo(studio: Studio) -> gr.Blocks:
    live: dict[str, RunView] = {}  # per browser session, server side (engine objects must not be deep-copied)
    replays: dict[str, tuple[str, int]] = {}
    stops: dict[str, threading.Event] = {}
    layers = studio.num_layers
    method_choices = [NO_LANE] + sorted(METHODS)

    with gr.Blocks(title="QEvict studio", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        with gr.Tabs(selected="run") as tabs:
            with gr.Tab("Run", id="run"):
                with gr.Row():
                    with gr.Column(scale=3):
                        example = gr.Dropdown(list(EXAMPLES), value=None, label="Example prompts", elem_id="example")
                        prompt = gr.Textbox(lines=8, max_lines=16, label="Prompt", elem_id="prompt")
                    with gr.Column(scale=2):
                        with gr.Row():
                            lane1 = gr.Dropdown(method_choices, value="fullkv", label="Lane 1", elem_id="lane1")
                            lane2 = gr.Dropdown(method_choices, value="snapkv", label="Lane 2", elem_id="lane2")
                            lane3 = gr.Dropdown(method_choices, value="qevict", label="Lane 3", elem_id="lane3")
                        with gr.Accordion("What each method keeps", open=False):
                            gr.Markdown(methods_markdown(), elem_id="methods")
                        budget = gr.Slider(0.02, 1.0, value=DEFAULTS.budget, step=0.01, label="KV budget (fraction of "
                                           "FullKV bytes)", elem_id="budget")
                        max_new = gr.Slider(1, 512, value=64, step=1, label="Max new tokens", elem_id="max-new")
                        with gr.Accordion("QEvict settings", open=False):
                            with gr.Row():
                                omega = gr.Slider(1, 64, value=DEFAULTS.omega, step=1,
                                                  label="Ω (window, routing interval)")
                                q_frac = gr.Slider(0.0, 1.0, value=DEFAULTS.q_frac, step=0.05,
                                                   label="q (quantized share)")
                            with gr.Row():
                                bits = gr.Radio([2, 4], value=DEFAULTS.bits, label="bits")
                                scorer = gr.Dropdown(list(studio.choices["scorers"]), value=DEFAULTS.scorer,
                                                     label="scorer")
                                promotion = gr.Checkbox(value=DEFAULTS.promotion, label="promotion")
                            with gr.Row():
                                sinks = gr.Number(value=DEFAULTS.sinks, precision=0, label="sinks")
                                recent = gr.Number(value=DEFAULTS.recent, precision=0, label="recent")
                                temperature = gr.Number(value=0.0, label="temperature (0 = greedy)")
                                seed = gr.Number(value=0, precision=0, label="seed")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                status = gr.Markdown(elem_id="status")
                lanes_out, stats, layer, tier_plot, heat_plot, prompt_view = view_panel("", layers)
                share = gr.Markdown(elem_id="share")
            with gr.Tab("Replay", id="replay"):
                with gr.Row():
                    replay_id = gr.Textbox(label="Session id", elem_id="replay-id", scale=3)
                    load_btn = gr.Button("Load", elem_id="replay-load", scale=1)
                replay_status = gr.Markdown(elem_id="replay-status")
                with gr.Row():
                    step = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="replay-step", scale=4)
                    play_btn = gr.Button("Play", elem_id="replay-play", scale=1)
                    pause_btn = gr.Button("Pause", elem_id="replay-pause", scale=1)
                timer = gr.Timer(0.4, active=False)
                replay_lanes, replay_stats, replay_layer, replay_tier, replay_heat, replay_prompt = \
                    view_panel("replay-", layers)
                diagnose_btn = gr.Button("Diagnostics against FullKV attention", elem_id="replay-diagnose")
                diagnostics_out = gr.Markdown(elem_id="replay-diagnostics")
            with gr.Tab("Sessions", id="sessions"):
                refresh_btn = gr.Button("Refresh", elem_id="sessions-refresh")
                sessions_table = gr.Dataframe(headers=["id", "created", "status", "lanes", "prompt"], interactive=False,
                                              elem_id="sessions-table")
                with gr.Row():
                    manage_id = gr.Textbox(label="Session id", elem_id="manage-id")
                    manage_token = gr.Textbox(label="Delete token", type="password", elem_id="manage-token")
                with gr.Row():
                    open_btn = gr.Button("Open in Replay", elem_id="open-session")
                    export_btn = gr.Button("Export JSON", elem_id="export-session")
                    delete_btn = gr.Button("Delete", variant="stop", elem_id="delete-session")
                export_file = gr.File(label="Exported session", elem_id="export-file")
                import_file = gr.File(label="Import a session (.json)", file_types=[".json"], elem_id="import-file")
                manage_status = gr.Markdown(elem_id="manage-status")

        # -- run ------------------------------------------------------------------------------------------------
        example.change(lambda name: EXAMPLES[name]() if name else gr.skip(), example, prompt, api_visibility="private")
        run_inputs = [prompt, lane1, lane2, lane3, budget, omega, q_frac, bits, sinks, recent, scorer, promotion,
                      max_new, temperature, seed, layer]
        run_outputs = [status, lanes_out, stats, tier_plot, heat_plot, prompt_view, share]

        @GPU(duration=300)
        def generate(prompt, lane1, lane2, lane3, budget, omega, q_frac, bits, sinks, recent, scorer, promotion,
                     max_new_tokens, temperature, seed, layer, request: gr.Request = None):
            """Run ``prompt`` through up to three caches; streams (status, lanes HTML, stats, tier map, score heatmap,
            prompt tiers, share link). Lanes are method names from `qevict_core.list_methods()` or "(none)"."""
            key = request.session_hash if request is not None else "api"
            try:
                req = parse_request(prompt, [lane1, lane2, lane3], budget, omega, q_frac, bits, sinks, recent, scorer,
                                    promotion, max_new_tokens, temperature, seed)
                stop = stops[key] = threading.Event()
                for update in studio.run(req, stop.is_set):
                    live[key] = update.view
                    word = {"running": "Generating…", "done": "Done.", "stopped": "Stopped — what was generated "
                            "is kept.", "error": f"Error: {update.message}"}[update.status]
                    routing = routing_outputs(update.view, int(layer)) if update.routing_changed else (gr.skip(),) * 3
                    yield (f"**{word}**", plots.lanes_html(update.view), plots.stats_rows(update.view), *routing,
                           share_markdown(update.session_id, update.delete_token, request))
            except ValueError as err:
                yield (f"**Cannot run:** {err}", gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())

        generate_btn.click(generate, run_inputs, run_outputs, api_name="generate", concurrency_id="gpu",
                           concurrency_limit=1)

        def request_stop(request: gr.Request):
            event = stops.get(request.session_hash)
            if event is not None:
                event.set()
            return "**Stopping…**"

        stop_btn.click(request_stop, None, status, queue=False, api_visibility="private")
        def redraw_layer(layer_v, request: gr.Request):
            return routing_outputs(live.get(request.session_hash), int(layer_v))

        layer.change(redraw_layer, layer, [tier_plot, heat_plot, prompt_view], api_visibility="private")

        # -- replay ---------------------------------------------------------------------------------------------
        def show_replay(session_id, step_v, layer_v, request: gr.Request):
            session_id = (session_id or "").strip()
            found = studio.replay(session_id, None if step_v is None else int(step_v))
            if found is None:
                return (f"**No such session:** `{session_id}`" if session_id else "Enter a session id.",
                        gr.skip(), "", [], *routing_outputs(None, 0))
            view, last = found
            replays[request.session_hash] = (session_id, last)
            shown = last if step_v is None else min(int(step_v), last)
            meta = studio.store.get(session_id)
            note = f"Session `{session_id}` — {meta['status']}, step {shown} of {last}"
            return (note, gr.update(maximum=max(last, 1), value=shown), plots.lanes_html(view),
                    plots.stats_rows(view), *routing_outputs(view, int(layer_v)))

        replay_outputs = [replay_status, step, replay_lanes, replay_stats, replay_tier, replay_heat, replay_prompt]
        def load_replay(session_id, layer_v, request: gr.Request):
            return show_replay(session_id, None, layer_v, request)

        load_btn.click(load_replay, [replay_id, replay_layer], replay_outputs, api_visibility="private")
        step.input(show_replay, [replay_id, step, replay_layer], replay_outputs, api_visibility="private")
        replay_layer.change(show_replay, [replay_id, step, replay_layer], replay_outputs, api_visibility="private")
        play_btn.click(lambda: gr.Timer(active=True), None, timer, api_visibility="private")
        pause_btn.click(lambda: gr.Timer(active=False), None, timer, api_visibility="private")

        def tick(session_id, step_v, layer_v, request: gr.Request):
            _, last = replays.get(request.session_hash, (None, 0))
            nxt = min(int(step_v or 0) + 1, last)
            outputs = show_replay(session_id, nxt, layer_v, request)
            return (*outputs, gr.Timer(active=nxt < last))

        timer.tick(tick, [replay_id, step, replay_layer], [*replay_outputs, timer], api_visibility="private")

        @GPU(duration=120)
        def run_diagnostics(session_id):
            return diagnose_session(studio, (session_id or "").strip())

        diagnose_btn.click(run_diagnostics, replay_id, diagnostics_out, concurrency_id="gpu", concurrency_limit=1,
                           api_visibility="private")

        # -- sessions -------------------------------------------------------------------------------------------
        def list_sessions():
            return [[s["id"], (s["created_at"] or "")[:19], s["status"],
                     ", ".join(lane["name"] for lane in s["request"].get("lanes", [])), s["title"][:80]]
                    for s in studio.store.list()]

        refresh_btn.click(list_sessions, None, sessions_table, api_visibility="private")
        def open_session(session_id, layer_v, request: gr.Request):
            return (gr.Tabs(selected="replay"), session_id, *show_replay(session_id, None, layer_v, request))

        open_btn.click(open_session, [manage_id, replay_layer], [tabs, replay_id, *replay_outputs],
                       api_visibility="private")

        def export_session(session_id):
            session_id = (session_id or "").strip()
            if studio.store.get(session_id) is None:
                return None, f"**No such session:** `{session_id}`"
            path = os.path.join(tempfile.mkdtemp(prefix="qevict-"), f"qevict-session-{session_id}.json")
            with open(path, "w") as handle:
                json.dump(studio.store.export(session_id), handle)
            return path, f"Exported `{session_id}`."

        export_btn.click(export_session, manage_id, [export_file, manage_status], api_visibility="private")

        def import_session(file):
            if file is None:
                return gr.skip(), gr.skip()
            try:
                with open(file if isinstance(file, str) else file.name) as handle:
                    new_id, token = studio.store.import_session(json.load(handle))
            except (ValueError, json.JSONDecodeError) as err:
                return f"**Import failed:** {err}", gr.skip()
            return (f"Imported as `{new_id}` — delete token `{token}` (shown once).", list_sessions())

        import_file.upload(import_session, import_file, [manage_status, sessions_table], api_visibility="private")

        def delete_session(session_id, token):
            if studio.store.delete((session_id or "").strip(), token or ""):
                return "Deleted.", list_sessions()
            return "**Not deleted:** unknown session id or wrong delete token.", gr.skip()

        delete_btn.click(delete_session, [manage_id, manage_token], [manage_status, sessions_table],
                         api_visibility="private")

        # -- deep links and cleanup -----------------------------------------------------------------------------
        def on_load(layer_v, request: gr.Request):
            session_id = request.query_params.get("session") if request is not None else None
            if not session_id:
                return (gr.skip(), gr.skip(), *([gr.skip()] * len(replay_outputs)), list_sessions())
            return (gr.Tabs(selected="replay"), session_id, *show_replay(session_id, None, layer_v, request),
                    list_sessions())

        demo.load(on_load, replay_layer, [tabs, replay_id, *replay_outputs, sessions_table], api_visibility="private")

        def forget(request: gr.Request):
            for table in (live, replays, stops):
                table.pop(request.session_hash, None)

        demo.unload(forget)
    return demo
