"""What the Run tab's controls do: plain methods over a ``Studio`` and the tabs' state, taking and returning named
objects (``ui/outputs.py``); ``blocks`` wires each by name. Nothing here builds Blocks, so every handler runs in a
test as it runs behind its control."""

from __future__ import annotations

import secrets
from typing import Iterator

import gradio as gr

from qevict_core.registry import METHODS
from storage.schema import MAX_PROMPT_CHARS

from . import sessions
from .control import TabRuns
from .examples import EXAMPLES
from .form import MAX_NEW_TOKENS, NO_LANE, Controls, parse_request
from .outputs import At, DraftOutputs, EditedOutputs, ExampleOutputs, RunOutputs, Shown, ViewOutputs
from .studio import Studio, lane_names
from .texts import progress_text, share_markdown
from .view import RunView

BOOT = secrets.token_hex(8)  # this server process: a draft saved under another one survived a restart


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


def picker_index(value, count: int, name: str) -> int:
    """A layer or head picker's value as an index; ValueError naming the range (API callers can send anything)."""
    try:
        index = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})") from None
    if index != value or not 0 <= index < count:
        raise ValueError(f"{name}: must be a whole number from 0 to {count - 1} (got {value!r})")
    return index


def key(request: gr.Request | None) -> str:
    """The browser tab a request comes from ("api" for a call without one)."""
    return request.session_hash if request is not None else "api"


class Pickers:
    """Checks a view's pickers against the model: what ``At`` a view is drawn at."""

    def __init__(self, studio: Studio):
        self.layers, self.heads = studio.num_layers, studio.num_kv_heads

    def at(self, shown: Shown, view: RunView | None) -> At:
        if not isinstance(shown.present, bool):
            raise ValueError(f"present: must be true or false (got {shown.present!r})")
        return At(picker_index(shown.layer, self.layers, "layer"), picker_index(shown.head, self.heads, "head"),
                  pick_lane(view, shown.shown_lane), shown.present)


class RunHandlers:
    """The Run tab: examples, the lane menus, Generate and Stop, the routing pickers, the tab's draft."""

    def __init__(self, studio: Studio, tabs: TabRuns):
        self.studio, self.tabs, self.pickers = studio, tabs, Pickers(studio)

    def pick_example(self, example: str | None) -> ExampleOutputs:
        """The example's prompt, answer, new tokens, layer shown, hint, and the settings it runs at (budget,
        temperature, seed: set every time, so an example never runs at the one picked before)."""
        if not example or example not in EXAMPLES:
            return ExampleOutputs()
        found = EXAMPLES[example]()
        out = ExampleOutputs(prompt=found.prompt, expected=found.expected, max_new_tokens=found.max_new_tokens,
                             hint=f"*{found.hint}*", budget=found.budget, temperature=found.temperature,
                             seed=found.seed)
        if found.layer is not None:  # where this model has it (a smaller model than the one it was found on: the last)
            out.layer = min(found.layer, self.pickers.layers - 1)
        return out

    def show_ablations(self, ablations: bool, lane1: str, lane2: str, lane3: str):
        """The three lane menus with or without the ablations; a lane set to an ablation keeps it."""
        return tuple(gr.update(choices=lane_choices(ablations or METHODS.get(v) is not None
                                                    and METHODS[v].kind == "ablation")) for v in (lane1, lane2, lane3))

    def shown_lane_menu(self, lane1: str, lane2: str, lane3: str):
        """The routing picker: the lanes of the chosen methods that route, the first selected."""
        chosen = tuple(m for m in (lane1, lane2, lane3) if m and m != NO_LANE)
        names = [name for name, method in zip(lane_names(chosen), chosen) if routes(method)]
        return gr.update(choices=names, value=names[0] if names else None)

    def arm(self, request: gr.Request) -> RunOutputs:
        self.tabs.arm(request.session_hash)
        return RunOutputs("**Waiting for a free slot…** One run at a time; your place in the queue shows here.",
                          ViewOutputs.cleared(), "")

    def generate(self, controls: Controls, shown: Shown, request: gr.Request = None) -> Iterator[RunOutputs]:
        """Run the prompt through up to three caches, streaming the status, the lanes, the stats table, the bytes
        plot, the routing views and the share link. Lanes are method names from `qevict_core.list_methods()` or
        "(none)". A refused request returns the reason in ``status``."""
        tab = key(request)
        flag = self.tabs.start(tab)
        if flag is None:
            yield RunOutputs("**Stopped** before it started: nothing was run.", ViewOutputs.cleared(), "")
            return
        try:
            req = parse_request(controls)
            self.pickers.at(shown, None)  # a bad picker is refused before anything runs
            for update in self.studio.run(req, flag.is_set):
                self.tabs.live[tab] = update.view
                first = update.view.step < 0 and update.status == "running"
                heavy = update.routing_changed or update.status != "running"
                at = self.pickers.at(shown, update.view)
                yield RunOutputs(progress_text(update),
                                 ViewOutputs.drawn(update.view, at, lambda name, r: heavy or name in ("lanes", "stats")),
                                 share_markdown(update.session_id, update.delete_token, request),
                                 {"id": update.session_id, "token": update.delete_token} if first else gr.skip())
        except ValueError as err:
            yield RunOutputs(f"**Cannot run:** {err}", ViewOutputs.cleared(), "")
        finally:
            self.tabs.finish(tab)

    def redraw_routing(self, shown: Shown, request: gr.Request) -> ViewOutputs:
        view = self.tabs.live.get(request.session_hash)
        return ViewOutputs.routing(view, self.pickers.at(shown, view))

    def prompt_edited(self, prompt: str, example: str | None) -> EditedOutputs:
        """A visitor edited the prompt: an example's answer and hint no longer belong to it (a new prompt would be
        judged against the example's answer)."""
        if not example or example not in EXAMPLES or prompt == EXAMPLES[example]().prompt:
            return EditedOutputs()
        return EditedOutputs(expected="", example=None, hint="")

    def save_draft(self, prompt: str, expected: str, max_new_tokens: int):
        """What the tab has set, kept in the browser (a restart or a reload must not lose it): the prompt, the
        expected answer and the new tokens, which an example sets with them."""
        if not isinstance(prompt, str) or not isinstance(expected, str):
            return gr.skip()
        return {"prompt": prompt[:MAX_PROMPT_CHARS], "expected": expected[:200], "max_new": max_new_tokens,
                "boot": BOOT}

    def restore_draft(self, draft, owned) -> DraftOutputs:
        """On load: the tab's draft back in the form, and, when the server restarted since it was saved, a line
        that says so and links the tab's latest run."""
        if not isinstance(draft, dict) or not isinstance(draft.get("prompt"), str) or not draft["prompt"]:
            return DraftOutputs()
        out = DraftOutputs(prompt=draft["prompt"],
                           expected=draft.get("expected") if isinstance(draft.get("expected"), str) else "")
        max_new = draft.get("max_new")
        if isinstance(max_new, int) and not isinstance(max_new, bool) and 1 <= max_new <= MAX_NEW_TOKENS:
            out.max_new_tokens = max_new
        if draft.get("boot") != BOOT:
            latest = [ref["id"] for ref in sessions.refs(owned)][:1]
            link = f" Your latest run: [/?session={latest[0]}](/?session={latest[0]})." if latest else ""
            out.status = (f"**The server restarted.** Your prompt is back in the box; a run that was going on was "
                          f"cut off (its replay says *interrupted*).{link}")
        return out

    def record(self, ref, owned):
        """A new run's {id, token} joins this browser's list."""
        return sessions.add(owned, ref["id"], ref["token"]) if ref else gr.skip()

    def request_stop(self, request: gr.Request):
        phase = self.tabs.stop(request.session_hash)
        if phase == "queued":
            return "**Stopped:** your queued run will not start."
        return "**Stopping** after the current step…" if phase == "running" else gr.skip()

    def forget(self, request: gr.Request):
        self.tabs.forget(request.session_hash)
