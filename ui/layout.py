"""The studio's Blocks: wiring only. Logic lives in ``handlers``, ``form`` and ``sessions``, drawing in ``plots``
and ``cards``, per-tab state in ``control``."""

from __future__ import annotations

import json
import os
import tempfile

import gradio as gr

from qevict_core import QEvictConfig
from qevict_core.registry import METHODS, resolve
from storage.schema import max_import_bytes

from . import cards, plots, sessions
from .components import FormSlider
from .control import TabRuns
from .examples import EXAMPLES
from .form import MAX_NEW_TOKENS, NO_LANE, parse_request
from .glossary import GLOSSARY
from .gpu import GPU
from .handlers import Studio, diagnose_session, progress_text
from .view import RunView

DEFAULTS = QEvictConfig()
INTRO = """# QEvict studio
Run one prompt through up to three KV caches side by side at the **same byte budget**: the uncompressed cache
(FullKV), a baseline and QEvict, which keeps most windows of past tokens in 4 bits that still take part in
attention and can be promoted back, the most-attended ones in full precision when the bytes allow, and evicts the
rest. Pick an example and press **Generate**. Every run
is saved; its share link replays it step by step."""
NO_RUN = plots.empty_figure("No run yet.")
CLEARED = ("", {"headers": ["measure"], "data": []}, NO_RUN, NO_RUN, NO_RUN, "", "")


def methods_markdown() -> str:
    rows = [f"| `{name}` | {spec.description} | {spec.reference} |" for name, spec in METHODS.items()
            if spec.kind == "method"]
    ablations = [f"| `{name}` | {spec.description} |" for name, spec in METHODS.items() if spec.kind == "ablation"]
    return ("| method | keeps | follows |\n|---|---|---|\n" + "\n".join(rows)
            + "\n\n**Ablations** (in the lane menus once *Show ablations* is ticked):\n\n| ablation | keeps |\n"
              "|---|---|\n" + "\n".join(ablations))


def lane_choices(ablations: bool) -> list[tuple[str, str]]:
    """A lane menu: the product's methods in the registry's order, then, when asked, the ablations, marked."""
    return ([(NO_LANE, NO_LANE)] + [(name, name) for name, spec in METHODS.items() if spec.kind == "method"]
            + [(f"ablation · {name}", name) for name, spec in METHODS.items() if ablations and spec.kind == "ablation"])


def show_ablations(ablations: bool, *values: str):
    """The three lane menus with or without the ablations; a lane set to an ablation keeps it."""
    return tuple(gr.update(choices=lane_choices(ablations or METHODS.get(v) is not None
                                                and METHODS[v].kind == "ablation")) for v in values)


def map_lane(view: RunView | None) -> str | None:
    """The lane whose routing the tier map shows: the first QEvict-family lane that has routed."""
    routed = view.routed_lanes() if view is not None else []
    return next((n for n in routed if METHODS[resolve(view.lanes[n].method)[0]].family == "qevict"),
                routed[0] if routed else None)


def routing_outputs(view: RunView | None, layer: int, head: int = 0) -> tuple:
    """(tier map, score heatmap, moves in words, prompt by tier); ``head`` matters for lanes routed per KV head."""
    if view is None:
        return CLEARED[3], CLEARED[4], "", ""
    lane = map_lane(view)
    return (plots.tier_map(view, lane, layer, head), plots.score_heatmap(view, lane, head),
            cards.moves_html(view, lane, layer, head), cards.prompt_html(view, lane, layer, head))


def share_markdown(session_id: str, token: str, request: gr.Request | None) -> str:
    host = os.environ.get("SPACE_HOST")
    base = f"https://{host}" if host else (f"http://{request.headers.get('host')}" if request is not None else "")
    link = f"{base}/?session={session_id}"
    return (f"**Share this run:** [{link}]({link}) — anyone with the link can open it. It is listed under "
            f"*Sessions* in this browser only, which can delete it; elsewhere, delete it with the token `{token}`.")


def view_panel(prefix: str, layers: int, heads: int) -> tuple:
    """What a run looks like, live (Run tab) or replayed: lanes, stats, bytes, layer and head pickers, routing
    views."""
    lanes = gr.HTML(elem_id=f"{prefix}lanes")
    stats = gr.Dataframe(headers=["measure"], interactive=False, elem_id=f"{prefix}stats", wrap=True,
                         max_height=440, column_widths=["34%"],
                         label="Lanes side by side (tokens per layer, moves in windows; see the glossary)")
    memory = gr.Plot(label="Bytes per tier", show_label=False, elem_id=f"{prefix}bytes")
    with gr.Row():
        layer = FormSlider(0, layers - 1, value=layers // 2, step=1, label=f"Layer shown below (0–{layers - 1})",
                          elem_id=f"{prefix}layer", scale=3)
        head = FormSlider(0, heads - 1, value=0, step=1, elem_id=f"{prefix}head", scale=2,
                         label=f"KV head shown, for qevict_head (routed per head; 0–{heads - 1})")
    with gr.Row(equal_height=False):
        tier = gr.Plot(label="Tier map", show_label=False, elem_id=f"{prefix}tier-map", min_width=320)
        heat = gr.Plot(label="Cumulative scores", show_label=False, elem_id=f"{prefix}heatmap", min_width=320)
    moves = gr.HTML(elem_id=f"{prefix}moves")
    prompt = gr.HTML(elem_id=f"{prefix}prompt-tiers")
    return lanes, stats, memory, layer, head, tier, heat, moves, prompt


def build_demo(studio: Studio) -> gr.Blocks:
    tabs_state = TabRuns()
    layers, heads = studio.num_layers, studio.num_kv_heads
    method_choices = lane_choices(False)

    with gr.Blocks(title="QEvict studio", analytics_enabled=False) as demo:
        owned = gr.BrowserState([], storage_key=sessions.STORAGE_KEY,
                                # The secret travels to the browser with the page, so it protects nothing; a fixed
                                # one keeps a visitor's list readable across server restarts.
                                secret=os.environ.get("QEVICT_BROWSER_SECRET", "qevict-studio"))
        gr.Markdown(INTRO)
        with gr.Tabs(selected="run") as tabs:
            with gr.Tab("Run", id="run"):
                with gr.Row():
                    with gr.Column(scale=3, min_width=300):
                        example = gr.Dropdown(list(EXAMPLES), value=None, label="Example prompts", elem_id="example")
                        prompt = gr.Textbox(lines=6, max_lines=14, label="Prompt", elem_id="prompt")
                        expected = gr.Textbox("", label="Expected answer (optional: each lane is checked for it)",
                                              elem_id="expected", max_length=200)
                    with gr.Column(scale=2, min_width=300):
                        with gr.Row():
                            lane1 = gr.Dropdown(method_choices, value="fullkv", label="Lane 1", elem_id="lane1")
                            lane2 = gr.Dropdown(method_choices, value="snapkv", label="Lane 2", elem_id="lane2")
                            lane3 = gr.Dropdown(method_choices, value="qevict", label="Lane 3", elem_id="lane3")
                        ablations = gr.Checkbox(False, label="Show ablations (R1, R2, no promotion, scorers, Ω, "
                                                "per-head routing, …) in the lane menus", elem_id="ablations")
                        budget = FormSlider(0.01, 1.0, value=DEFAULTS.budget, step=0.01, elem_id="budget",
                                           label="KV budget: share of FullKV's bytes (0.01–1)")
                        max_new = FormSlider(1, MAX_NEW_TOKENS, value=64, step=1, elem_id="max-new",
                                            label=f"Max new tokens (1–{MAX_NEW_TOKENS})")
                        with gr.Accordion("QEvict settings", open=False):
                            with gr.Row():
                                omega = FormSlider(1, 64, value=DEFAULTS.omega, step=1, label="Ω: window and routing "
                                                  "interval, tokens (1–64)")
                                q_frac = FormSlider(0.0, 1.0, value=DEFAULTS.q_frac, step=0.05,
                                                   label="q: share of the history budget in low bits (0–1)")
                                coverage = FormSlider(0.0, 1.0, value=DEFAULTS.coverage or 0.0, step=0.05, elem_id="coverage",
                                                      label="coverage κ: share of the windows the low-bit tier is "
                                                            "sized for first (0 = split by q)")
                            with gr.Row():
                                bits = gr.Radio([2, 4], value=DEFAULTS.bits, label="low-bit tier: bits")
                                scorer = gr.Dropdown(list(studio.choices["scorers"]), value=DEFAULTS.scorer,
                                                     label="scorer")
                                promotion = gr.Checkbox(value=DEFAULTS.promotion, label="promotion")
                            with gr.Row():
                                # No minimum/maximum here: Gradio would refuse before our form could say why.
                                sinks = gr.Number(value=DEFAULTS.sinks, label="sinks (0–64)")
                                recent = gr.Number(value=DEFAULTS.recent, label="recent (0–1024)")
                                temperature = gr.Number(value=0.0, label="temperature (0 = greedy, up to 2)")
                                seed = gr.Number(value=0, label="seed (0 or more)")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                status = gr.Markdown(elem_id="status")
                (lanes_out, stats, memory, layer, head, tier_plot, heat_plot, moves,
                 prompt_view) = view_panel("", layers, heads)
                share = gr.Markdown(elem_id="share")
                with gr.Accordion("What each method keeps", open=False):
                    gr.Markdown(methods_markdown(), elem_id="methods")
                with gr.Accordion("Glossary: tiers, columns, diagnostics", open=False):
                    gr.Markdown(GLOSSARY, elem_id="glossary")
            with gr.Tab("Replay", id="replay"):
                with gr.Row():
                    replay_id = gr.Textbox(label="Session id", elem_id="replay-id", scale=3)
                    load_btn = gr.Button("Load", elem_id="replay-load", scale=1)
                replay_status = gr.Markdown(elem_id="replay-status")
                with gr.Row():
                    step = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="replay-step", scale=4)
                    play_btn = gr.Button("Play", elem_id="replay-play", scale=1, min_width=80)
                    pause_btn = gr.Button("Pause", elem_id="replay-pause", scale=1, min_width=80)
                timer = gr.Timer(0.4, active=False)
                replay_panel = view_panel("replay-", layers, heads)
                replay_layer, replay_head = replay_panel[3], replay_panel[4]
                diagnose_btn = gr.Button("Diagnostics against FullKV attention", elem_id="replay-diagnose")
                diagnostics_out = gr.Markdown(elem_id="replay-diagnostics")
                with gr.Accordion("Glossary: tiers, columns, diagnostics", open=False):
                    gr.Markdown(GLOSSARY)
            with gr.Tab("Sessions", id="sessions") as sessions_tab:
                gr.Markdown("Runs made or imported **in this browser** (kept in its local storage, with their "
                            "delete tokens). Nobody else sees this list; a share link opens one run.")
                sessions_table = gr.Dataframe(headers=sessions.SESSION_HEADERS, interactive=False,
                                              elem_id="sessions-table", wrap=True)
                manage_id = gr.Textbox(label="Session id (click a row)", elem_id="manage-id")
                with gr.Row():
                    open_btn = gr.Button("Open in Replay", elem_id="open-session")
                    export_btn = gr.Button("Export JSON", elem_id="export-session")
                    delete_btn = gr.Button("Delete", variant="stop", elem_id="delete-session")
                with gr.Accordion("Delete a session made in another browser", open=False):
                    manage_token = gr.Textbox(label="Delete token", type="password", elem_id="manage-token")
                export_file = gr.File(label="Exported session", elem_id="export-file")
                import_file = gr.File(label=f"Import a session (.json, up to {max_import_bytes() / 2**20:.0f} MiB)",
                                      file_types=[".json"], elem_id="import-file")
                manage_status = gr.Markdown(elem_id="manage-status")

        # -- run ------------------------------------------------------------------------------------------------
        def pick_example(name):
            if not name:
                return gr.skip(), gr.skip()
            prompt_text, answer = EXAMPLES[name]()
            return prompt_text, answer

        example.change(pick_example, example, [prompt, expected], api_visibility="private")
        ablations.change(show_ablations, [ablations, lane1, lane2, lane3], [lane1, lane2, lane3],
                         api_visibility="private")
        run_inputs = [prompt, lane1, lane2, lane3, budget, omega, q_frac, bits, sinks, recent, scorer, promotion,
                      max_new, temperature, seed, layer, expected, head, coverage]
        view_outputs = [lanes_out, stats, memory, tier_plot, heat_plot, moves, prompt_view]
        new_ref = gr.State(None)  # the run's {id, token}, handed to the browser's list (not part of the API)
        run_outputs = [status, *view_outputs, share, new_ref]

        def arm(request: gr.Request):
            tabs_state.arm(request.session_hash)
            return ("**Waiting for a free slot…** One run at a time; your place in the queue shows here.",
                    *CLEARED, "")

        @GPU(duration=300)
        def generate(prompt, lane1, lane2, lane3, budget, omega, q_frac, bits, sinks, recent, scorer, promotion,
                     max_new_tokens, temperature, seed, layer, expected="", head=0, coverage=DEFAULTS.coverage or 0.0,
                     request: gr.Request = None):
            """Run ``prompt`` through up to three caches; streams (status, lanes HTML, stats table, bytes plot, tier
            map, score heatmap, routing moves, prompt by tier, share link). Lanes are method names from
            `qevict_core.list_methods()` or "(none)". A refused request returns the reason in ``status``."""
            key = request.session_hash if request is not None else "api"
            flag = tabs_state.start(key)
            if flag is None:
                yield ("**Stopped** before it started: nothing was run.", *CLEARED, "", gr.skip())
                return
            try:
                req = parse_request(prompt, [lane1, lane2, lane3], budget, omega, q_frac, bits, sinks, recent,
                                    scorer, promotion, max_new_tokens, temperature, seed, expected, coverage)
                shown = picker_index(layer, layers, "layer"), picker_index(head, heads, "head")
                for update in studio.run(req, flag.is_set):
                    tabs_state.live[key] = update.view
                    first = update.view.step < 0 and update.status == "running"
                    heavy = update.routing_changed or update.status != "running"
                    routing = routing_outputs(update.view, *shown) if heavy else (gr.skip(),) * 4
                    yield (progress_text(update, studio), cards.lanes_html(update.view),
                           cards.stats_table(update.view), plots.bytes_plot(update.view) if heavy else gr.skip(),
                           *routing, share_markdown(update.session_id, update.delete_token, request),
                           {"id": update.session_id, "token": update.delete_token} if first else gr.skip())
            except ValueError as err:
                yield (f"**Cannot run:** {err}", *CLEARED, "", gr.skip())
            finally:
                tabs_state.finish(key)

        generate_btn.click(arm, None, [status, *view_outputs, share], queue=False, api_visibility="private").then(
            generate, run_inputs, run_outputs, api_name="generate", concurrency_id="gpu",
            concurrency_limit=1, show_progress_on=[status])

        def record(ref, owned_state):
            return sessions.add(owned_state, ref["id"], ref["token"]) if ref else gr.skip()

        new_ref.change(record, [new_ref, owned], owned, api_visibility="private")

        def request_stop(request: gr.Request):
            phase = tabs_state.stop(request.session_hash)
            if phase == "queued":
                return "**Stopped:** your queued run will not start."
            return "**Stopping** after the current step…" if phase == "running" else gr.skip()

        stop_btn.click(request_stop, None, status, queue=False, api_visibility="private")

        def redraw_routing(layer_v, head_v, request: gr.Request):
            return routing_outputs(tabs_state.live.get(request.session_hash), picker_index(layer_v, layers, "layer"),
                                   picker_index(head_v, heads, "head"))

        for picker in (layer, head):
            picker.change(redraw_routing, [layer, head], [tier_plot, heat_plot, moves, prompt_view],
                          api_visibility="private")

        # -- replay ---------------------------------------------------------------------------------------------
        def show_replay(session_id, step_v, layer_v, head_v, request: gr.Request):
            session_id = (session_id or "").strip()
            if not session_id:
                return ("Enter a session id, or open a share link.", gr.skip(), *CLEARED)
            try:
                view, last, meta = studio.replay(session_id, None if step_v is None else int(step_v))
            except (LookupError, ValueError) as err:
                return (f"**{err}**", gr.skip(), *CLEARED)
            tabs_state.replays[request.session_hash] = (session_id, last)
            shown = last if step_v is None else min(int(step_v), last)
            note = f"Session `{session_id}` — {meta['status']}, step {shown} of {last}"
            return (note, gr.update(maximum=max(last, 1), value=shown), cards.lanes_html(view),
                    cards.stats_table(view), plots.bytes_plot(view),
                    *routing_outputs(view, picker_index(layer_v, layers, "layer"), picker_index(head_v, heads, "head")))

        replay_outputs = [replay_status, step, *[c for c in replay_panel if c not in (replay_layer, replay_head)]]
        replay_inputs = [replay_id, step, replay_layer, replay_head]

        def load_replay(session_id, layer_v, head_v, request: gr.Request):
            return show_replay(session_id, None, layer_v, head_v, request)

        load_btn.click(load_replay, [replay_id, replay_layer, replay_head], replay_outputs, api_visibility="private")
        step.input(show_replay, replay_inputs, replay_outputs, api_visibility="private")
        for picker in (replay_layer, replay_head):
            picker.change(show_replay, replay_inputs, replay_outputs, api_visibility="private")
        play_btn.click(lambda: gr.Timer(active=True), None, timer, api_visibility="private")
        pause_btn.click(lambda: gr.Timer(active=False), None, timer, api_visibility="private")

        def tick(session_id, step_v, layer_v, head_v, request: gr.Request):
            _, last = tabs_state.replays.get(request.session_hash, (None, 0))
            nxt = min(int(step_v or 0) + 1, last)
            return (*show_replay(session_id, nxt, layer_v, head_v, request), gr.Timer(active=nxt < last))

        timer.tick(tick, replay_inputs, [*replay_outputs, timer], api_visibility="private")

        @GPU(duration=120)
        def run_diagnostics(session_id):
            try:
                return diagnose_session(studio, (session_id or "").strip())
            except Exception as err:  # the page says why, whatever a stored run holds
                return f"**Diagnostics failed:** {type(err).__name__}: {str(err)[:300]}"

        diagnose_btn.click(run_diagnostics, replay_id, diagnostics_out, concurrency_id="gpu", concurrency_limit=1,
                           api_visibility="private")

        # -- sessions -------------------------------------------------------------------------------------------
        def list_sessions(owned_state):
            return sessions.rows(studio.store, owned_state)

        owned.change(list_sessions, owned, sessions_table, api_visibility="private")
        sessions_tab.select(list_sessions, owned, sessions_table, api_visibility="private")
        def pick_row(evt: gr.SelectData):
            return evt.row_value[0] if evt.row_value else gr.skip()

        sessions_table.select(pick_row, None, manage_id, api_visibility="private")

        def open_session(session_id, layer_v, head_v, request: gr.Request):
            return (gr.Tabs(selected="replay"), session_id, *show_replay(session_id, None, layer_v, head_v, request))

        open_btn.click(open_session, [manage_id, replay_layer, replay_head], [tabs, replay_id, *replay_outputs],
                       api_visibility="private")

        def export_session(session_id):
            session_id = (session_id or "").strip()
            if studio.store.get(session_id) is None:
                return None, f"**No such session:** `{session_id[:64]}`"
            path = os.path.join(tempfile.mkdtemp(prefix="qevict-"), f"qevict-session-{session_id}.json")
            with open(path, "w") as handle:
                json.dump(studio.store.export(session_id), handle)
            return path, f"Exported `{session_id}`."

        export_btn.click(export_session, manage_id, [export_file, manage_status], api_visibility="private")

        def import_session(file, owned_state):
            if file is None:
                return gr.skip(), gr.skip()
            path = file if isinstance(file, str) else file.name
            try:
                if os.path.getsize(path) > max_import_bytes():
                    raise ValueError(f"the file is larger than the import limit of "
                                     f"{max_import_bytes() / 2**20:.0f} MiB")
                with open(path, "rb") as handle:
                    new_id, token = studio.store.import_session(handle.read())
            except ValueError as err:
                return f"**Import refused, nothing was stored:** {err}", gr.skip()
            return (f"Imported as `{new_id}` — listed above; open it with **Open in Replay**.",
                    sessions.add(owned_state, new_id, token))

        import_file.upload(import_session, [import_file, owned], [manage_status, owned], api_visibility="private")

        def delete_session(session_id, typed_token, owned_state):
            session_id = (session_id or "").strip()
            token = sessions.token_for(owned_state, session_id) or (typed_token or "")
            if studio.store.delete(session_id, token):
                return "Deleted.", sessions.remove(owned_state, session_id)
            return "**Not deleted:** unknown session id or wrong delete token.", gr.skip()

        delete_btn.click(delete_session, [manage_id, manage_token, owned], [manage_status, owned],
                         api_visibility="private")

        # -- deep links and cleanup -----------------------------------------------------------------------------
        def on_load(layer_v, head_v, owned_state, request: gr.Request):
            listed = sessions.rows(studio.store, owned_state)
            session_id = request.query_params.get("session") if request is not None else None
            if not session_id:
                return (gr.skip(), gr.skip(), *([gr.skip()] * len(replay_outputs)), listed)
            return (gr.Tabs(selected="replay"), session_id, *show_replay(session_id, None, layer_v, head_v, request),
                    listed)

        demo.load(on_load, [replay_layer, replay_head, owned], [tabs, replay_id, *replay_outputs, sessions_table],
                  api_visibility="private")
        def forget(request: gr.Request):
            tabs_state.forget(request.session_hash)

        demo.unload(forget)
    return demo


def picker_index(value, count: int, name: str) -> int:
    """A layer or head picker's value as an index; ValueError naming the range (API callers can send anything)."""
    try:
        index = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})") from None
    if index != value or not 0 <= index < count:
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})")
    return index
