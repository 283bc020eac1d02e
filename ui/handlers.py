"""What the studio's controls do: one plain method per event, over a ``Studio`` and the tabs' state. Nothing here
builds Blocks, so every handler runs in a test as it runs behind a button (``blocks`` wires them)."""

from __future__ import annotations

import json
import os
import secrets
import tempfile

import gradio as gr

from qevict_core.registry import METHODS
from storage.schema import MAX_PROMPT_CHARS, max_import_bytes

from . import cards, plots, sessions
from .control import TabRuns
from .examples import EXAMPLES
from .form import MAX_NEW_TOKENS, NO_LANE, parse_request
from .studio import Studio, diagnose_session, lane_names, progress_text
from .view import RunView

NO_RUN = plots.empty_figure("No run yet.")
BOOT = secrets.token_hex(8)  # this server process: a draft saved under another one survived a restart
CLEARED = ("", {"headers": ["measure"], "data": []}, NO_RUN, NO_RUN, NO_RUN, "", "")


def lane_choices(ablations: bool) -> list[tuple[str, str]]:
    """A lane menu: the product's methods in the registry's order, then, when asked, the ablations, marked."""
    return ([(NO_LANE, NO_LANE)] + [(name, name) for name, spec in METHODS.items() if spec.kind == "method"]
            + [(f"ablation · {name}", name) for name, spec in METHODS.items() if ablations and spec.kind == "ablation"])


def routes(method) -> bool:
    """Whether a lane of ``method`` has routing to draw (the QEvict family)."""
    return isinstance(method, str) and method in METHODS and METHODS[method].family == "qevict"


def pick_lane(view: RunView | None, wanted: str | None) -> str | None:
    """The lane whose routing the views show: ``wanted`` when it has routed, else the first QEvict-family lane."""
    routed = view.routed_lanes() if view is not None else []
    if wanted in routed:
        return wanted
    return next((n for n in routed if routes(view.lanes[n].method)), routed[0] if routed else None)


def routing_outputs(view: RunView | None, layer: int, head: int = 0, lane: str | None = None) -> tuple:
    """(tier map, score heatmap, moves in words, prompt by tier) of one lane; ``head`` matters for lanes routed per
    KV head."""
    if view is None:
        return CLEARED[3], CLEARED[4], "", ""
    lane = pick_lane(view, lane)
    return (plots.tier_map(view, lane, layer, head), plots.score_heatmap(view, lane, head),
            cards.moves_html(view, lane, layer, head), cards.prompt_html(view, lane, layer, head))


def picker_index(value, count: int, name: str) -> int:
    """A layer or head picker's value as an index; ValueError naming the range (API callers can send anything)."""
    try:
        index = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})") from None
    if index != value or not 0 <= index < count:
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})")
    return index


def share_markdown(session_id: str, token: str, request: gr.Request | None) -> str:
    host = os.environ.get("SPACE_HOST")
    base = f"https://{host}" if host else (f"http://{request.headers.get('host')}" if request is not None else "")
    link = f"{base}/?session={session_id}"
    return (f"**Share this run:** [{link}]({link}) — anyone with the link can open it. It is listed under "
            f"*Sessions* in this browser only, which can delete it; elsewhere, delete it with the token `{token}`.")


def _key(request: gr.Request | None) -> str:
    return request.session_hash if request is not None else "api"


class Handlers:
    """The handlers of one studio. Each returns the values of the outputs ``blocks`` wires it to."""

    def __init__(self, studio: Studio):
        self.studio, self.tabs = studio, TabRuns()
        self.layers, self.heads = studio.num_layers, studio.num_kv_heads

    def _pickers(self, layer, head) -> tuple[int, int]:
        return picker_index(layer, self.layers, "layer"), picker_index(head, self.heads, "head")

    # -- run ------------------------------------------------------------------------------------------------------
    def pick_example(self, name):
        """(prompt, expected answer, new tokens, layer shown, what to look at, budget) of an example."""
        if not name or name not in EXAMPLES:
            return (gr.skip(),) * 6
        example = EXAMPLES[name]()
        # the example's layer where this model has it (a smaller model than the one it was found on: the last)
        layer = min(example.layer, self.layers - 1) if example.layer is not None else gr.skip()
        budget = example.budget if example.budget is not None else gr.skip()
        return example.prompt, example.expected, example.max_new_tokens, layer, f"*{example.hint}*", budget

    def show_ablations(self, ablations: bool, *values: str):
        """The three lane menus with or without the ablations; a lane set to an ablation keeps it."""
        return tuple(gr.update(choices=lane_choices(ablations or METHODS.get(v) is not None
                                                    and METHODS[v].kind == "ablation")) for v in values)

    def shown_lane_menu(self, *methods: str):
        """The routing picker of the Run tab: the lanes of the chosen methods that route, the first selected."""
        chosen = tuple(m for m in methods if m and m != NO_LANE)
        names = [name for name, method in zip(lane_names(chosen), chosen) if routes(method)]
        return gr.update(choices=names, value=names[0] if names else None)

    def arm(self, request: gr.Request):
        self.tabs.arm(request.session_hash)
        return ("**Waiting for a free slot…** One run at a time; your place in the queue shows here.",
                *CLEARED, "")

    def generate(self, prompt, lane1, lane2, lane3, budget, omega, q_frac, bits, sinks, recent, scorer, promotion,
                 max_new_tokens, temperature, seed, layer, expected="", head=0, coverage=0.7, shown_lane=None,
                 request: gr.Request = None):
        """Run ``prompt`` through up to three caches; streams (status, lanes HTML, stats table, bytes plot, tier
        map, score heatmap, routing moves, prompt by tier, share link). Lanes are method names from
        `qevict_core.list_methods()` or "(none)". A refused request returns the reason in ``status``."""
        key = _key(request)
        flag = self.tabs.start(key)
        if flag is None:
            yield ("**Stopped** before it started: nothing was run.", *CLEARED, "", gr.skip())
            return
        try:
            req = parse_request(prompt, [lane1, lane2, lane3], budget, omega, q_frac, bits, sinks, recent,
                                scorer, promotion, max_new_tokens, temperature, seed, expected, coverage)
            shown = self._pickers(layer, head)
            for update in self.studio.run(req, flag.is_set):
                self.tabs.live[key] = update.view
                first = update.view.step < 0 and update.status == "running"
                heavy = update.routing_changed or update.status != "running"
                routing = routing_outputs(update.view, *shown, shown_lane) if heavy else (gr.skip(),) * 4
                yield (progress_text(update, self.studio), cards.lanes_html(update.view),
                       cards.stats_table(update.view), plots.bytes_plot(update.view) if heavy else gr.skip(),
                       *routing, share_markdown(update.session_id, update.delete_token, request),
                       {"id": update.session_id, "token": update.delete_token} if first else gr.skip())
        except ValueError as err:
            yield (f"**Cannot run:** {err}", *CLEARED, "", gr.skip())
        finally:
            self.tabs.finish(key)

    def prompt_edited(self, prompt, example):
        """A visitor edited the prompt: an example's answer and hint no longer belong to it (a new prompt would be
        judged against the example's answer). -> (expected answer, example picked, hint)."""
        if not example or example not in EXAMPLES or prompt == EXAMPLES[example]().prompt:
            return gr.skip(), gr.skip(), gr.skip()
        return "", None, ""

    def save_draft(self, prompt, expected, max_new):
        """What the tab has set, kept in the browser (a restart or a reload must not lose it): the prompt, the
        expected answer and the new tokens, which an example sets with them."""
        if not isinstance(prompt, str) or not isinstance(expected, str):
            return gr.skip()
        return {"prompt": prompt[:MAX_PROMPT_CHARS], "expected": expected[:200], "max_new": max_new, "boot": BOOT}

    def restore_draft(self, draft, owned):
        """On load: the tab's draft back in the form, and, when the server restarted since it was saved, a line
        that says so and links the tab's latest run. -> (prompt, expected answer, max new tokens, status)."""
        if not isinstance(draft, dict) or not isinstance(draft.get("prompt"), str) or not draft["prompt"]:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        expected = draft.get("expected") if isinstance(draft.get("expected"), str) else ""
        max_new = draft.get("max_new")
        max_new = max_new if isinstance(max_new, int) and not isinstance(max_new, bool) and \
            1 <= max_new <= MAX_NEW_TOKENS else gr.skip()
        if draft.get("boot") == BOOT:
            return draft["prompt"], expected, max_new, gr.skip()
        latest = [ref["id"] for ref in sessions.refs(owned)][:1]
        link = f" Your latest run: [/?session={latest[0]}](/?session={latest[0]})." if latest else ""
        return (draft["prompt"], expected, max_new,
                f"**The server restarted.** Your prompt is back in the box; a run that was going on was cut off "
                f"(its replay says *interrupted*).{link}")

    def record(self, ref, owned):
        """A new run's {id, token} joins this browser's list."""
        return sessions.add(owned, ref["id"], ref["token"]) if ref else gr.skip()

    def request_stop(self, request: gr.Request):
        phase = self.tabs.stop(request.session_hash)
        if phase == "queued":
            return "**Stopped:** your queued run will not start."
        return "**Stopping** after the current step…" if phase == "running" else gr.skip()

    def redraw_routing(self, layer, head, lane, request: gr.Request):
        return routing_outputs(self.tabs.live.get(request.session_hash), *self._pickers(layer, head), lane)

    def forget(self, request: gr.Request):
        self.tabs.forget(request.session_hash)

    # -- replay ---------------------------------------------------------------------------------------------------
    def show_replay(self, session_id, step, layer, head, lane, request: gr.Request):
        """(status, step slider, lane picker, lanes, stats, bytes, tier map, heatmap, moves, prompt by tier)."""
        session_id = (session_id or "").strip()
        if not session_id:
            return ("Enter a session id, or open a share link.", gr.skip(), gr.skip(), *CLEARED)
        try:
            view, last, meta = self.studio.replay(session_id, None if step is None else int(step))
            shown = self._pickers(layer, head)
        except (LookupError, ValueError) as err:
            return (f"**{err}**", gr.skip(), gr.skip(), *CLEARED)
        self.tabs.replays[_key(request)] = (session_id, last)
        at = last if step is None else min(int(step), last)
        lane = pick_lane(view, lane)
        note = f"Session `{session_id}` — {meta['status']}, step {at} of {last}"
        return (note, gr.update(maximum=max(last, 1), value=at),
                gr.update(choices=view.routed_lanes(), value=lane), cards.lanes_html(view),
                cards.stats_table(view), plots.bytes_plot(view), *routing_outputs(view, *shown, lane))

    def load_replay(self, session_id, layer, head, lane, request: gr.Request):
        return self.show_replay(session_id, None, layer, head, lane, request)

    def play(self, request: gr.Request):
        self.tabs.paused.discard(_key(request))
        return gr.Timer(active=True)

    def pause(self, request: gr.Request):
        self.tabs.paused.add(_key(request))
        return gr.Timer(active=False)

    def tick(self, session_id, step, layer, head, lane, request: gr.Request):
        if _key(request) in self.tabs.paused:  # a tick that left the browser before Pause: no further step
            return (*([gr.skip()] * 12), gr.Timer(active=False))
        _, last = self.tabs.replays.get(_key(request), (None, 0))
        nxt = min(int(step or 0) + 1, last)
        return (*self.show_replay(session_id, nxt, layer, head, lane, request), gr.Timer(active=nxt < last))

    def run_diagnostics(self, session_id):
        try:
            return diagnose_session(self.studio, (session_id or "").strip())
        except Exception as err:  # the page says why, whatever a stored run holds
            return f"**Diagnostics failed:** {type(err).__name__}: {str(err)[:300]}"

    def time_lanes(self, session_id):
        try:
            return self.studio.time_lanes((session_id or "").strip())
        except (LookupError, ValueError) as err:
            return f"**Cannot time this run:** {err}"

    # -- sessions -------------------------------------------------------------------------------------------------
    def list_sessions(self, owned):
        """The table of this browser's runs, its label saying how many (an empty table reads as "none", not as
        "not loaded yet")."""
        listed = sessions.rows(self.studio.store, owned)
        return gr.update(value=listed, label=sessions.count_label(len(listed)))

    def pick_row(self, evt: gr.SelectData):
        return evt.row_value[0] if evt.row_value else gr.skip()

    def open_session(self, session_id, layer, head, lane, request: gr.Request):
        return (gr.Tabs(selected="replay"), session_id, *self.show_replay(session_id, None, layer, head, lane, request))

    def export_session(self, session_id):
        """-> (the download box, shown only with a file in it, and a status line)."""
        session_id = (session_id or "").strip()
        if self.studio.store.get(session_id) is None:
            return gr.update(value=None, visible=False), f"**No such session:** `{session_id[:64]}`"
        path = os.path.join(tempfile.mkdtemp(prefix="qevict-"), f"qevict-session-{session_id}.json")
        with open(path, "w") as handle:
            json.dump(self.studio.store.export(session_id), handle)
        return gr.update(value=path, visible=True), f"Exported `{session_id}`: download it below."

    def import_session(self, file, owned):
        if file is None:  # cleared, or a file the browser refused: no earlier file's reason stays on screen
            return "", gr.skip()
        path = file if isinstance(file, str) else file.name
        try:
            if os.path.getsize(path) > max_import_bytes():
                raise ValueError(f"the file is larger than the import limit of {max_import_bytes() / 2**20:.0f} MiB")
            with open(path, "rb") as handle:
                new_id, token = self.studio.store.import_session(handle.read())
        except ValueError as err:
            return f"**Import refused, nothing was stored:** {err}", gr.skip()
        return (f"Imported as `{new_id}` — listed above; open it with **Open in Replay**.",
                sessions.add(owned, new_id, token))

    def ask_delete(self, session_id):
        """Delete asks first: -> (the confirm button, the status line)."""
        session_id = (session_id or "").strip()
        if not session_id:
            return gr.update(visible=False), "Pick a session first (click a row)."
        return (gr.update(visible=True),
                f"Delete `{session_id[:64]}` for good? Its share link stops working. **Confirm delete** to go on.")

    def delete_session(self, session_id, typed_token, owned):
        session_id = (session_id or "").strip()
        token = sessions.token_for(owned, session_id) or (typed_token or "")
        if self.studio.store.delete(session_id, token):
            return "Deleted.", sessions.remove(owned, session_id), gr.update(visible=False)
        return "**Not deleted:** unknown session id or wrong delete token.", gr.skip(), gr.update(visible=False)

    def on_load(self, layer, head, lane, owned, request: gr.Request):
        """A share link (``?session=``) opens its run in Replay; the Sessions table lists this browser's runs."""
        listed = self.list_sessions(owned)
        session_id = request.query_params.get("session") if request is not None else None
        if not session_id:
            return (gr.skip(), gr.skip(), *([gr.skip()] * 10), listed)
        return (gr.Tabs(selected="replay"), session_id,
                *self.show_replay(session_id, None, layer, head, lane, request), listed)
