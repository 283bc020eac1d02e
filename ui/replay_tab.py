"""What the Replay tab's controls do: a stored run at a step, played, diagnosed and timed (named inputs and outputs,
as ``run_tab``)."""

from __future__ import annotations

import gradio as gr

from .control import TabRuns
from .outputs import ReplayOutputs, Shown, TickOutputs, ViewOutputs
from .run_tab import Pickers, key
from .studio import Studio, diagnose_run
from .texts import diagnostics_markdown, timing_markdown


class ReplayHandlers:
    def __init__(self, studio: Studio, tabs: TabRuns):
        self.studio, self.tabs, self.pickers = studio, tabs, Pickers(studio)

    def show_replay(self, session_id: str, step, shown: Shown, request: gr.Request = None) -> ReplayOutputs:
        """The stored run ``session_id`` at ``step`` (None: its end), drawn at the pickers."""
        session_id = (session_id or "").strip()
        if not session_id:
            return ReplayOutputs("Enter a session id, or open a share link.", view=ViewOutputs.cleared())
        try:
            view, last, meta = self.studio.replay(session_id, None if step is None else int(step))
            at = self.pickers.at(shown, view)
        except (LookupError, ValueError) as err:
            return ReplayOutputs(f"**{err}**", view=ViewOutputs.cleared())
        self.tabs.replays[key(request)] = (session_id, last)
        step = last if step is None else min(int(step), last)
        return ReplayOutputs(f"Session `{session_id}` — {meta['status']}, step {step} of {last}",
                             gr.update(maximum=max(last, 1), value=step),
                             gr.update(choices=view.routed_lanes(), value=at.lane), ViewOutputs.drawn(view, at))

    def redraw(self, session_id: str, step, shown: Shown, request: gr.Request = None) -> ReplayOutputs:
        """A picker, the step slider or presentation mode changed: the loaded replay redrawn; with none loaded,
        nothing touched (no "enter a session id" for a visitor who only ticked presentation mode)."""
        if not (session_id or "").strip():
            return ReplayOutputs()
        return self.show_replay(session_id, step, shown, request)

    def load_replay(self, session_id: str, shown: Shown, request: gr.Request) -> ReplayOutputs:
        return self.show_replay(session_id, None, shown, request)

    def play(self, request: gr.Request):
        self.tabs.paused.discard(key(request))
        return gr.Timer(active=True)

    def pause(self, request: gr.Request):
        self.tabs.paused.add(key(request))
        return gr.Timer(active=False)

    def tick(self, session_id: str, step, shown: Shown, request: gr.Request) -> TickOutputs:
        if key(request) in self.tabs.paused:  # a tick that left the browser before Pause: no further step
            return TickOutputs(timer=gr.Timer(active=False))
        _, last = self.tabs.replays.get(key(request), (None, 0))
        nxt = min(int(step or 0) + 1, last)
        shown_now = self.show_replay(session_id, nxt, shown, request)
        return TickOutputs(**vars(shown_now), timer=gr.Timer(active=nxt < last))

    def run_diagnostics(self, session_id: str) -> str:
        try:
            return diagnostics_markdown(diagnose_run(self.studio, (session_id or "").strip()))
        except (LookupError, ValueError) as err:
            return f"**{err}**"
        except Exception as err:  # the page says why, whatever a stored run holds
            return f"**Diagnostics failed:** {type(err).__name__}: {str(err)[:300]}"

    def time_lanes(self, session_id: str) -> str:
        try:
            return timing_markdown(self.studio.time_lanes((session_id or "").strip()))
        except (LookupError, ValueError) as err:
            return f"**Cannot time this run:** {err}"

