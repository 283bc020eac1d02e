"""Calls the studio's tests share: a checked run request, a hand-written event folded into a view, and what the
Replay tab's diagnostics button shows."""

from qevict_core.events import event_from_dict
from ui.control import TabRuns
from ui.form import Controls, parse_request
from ui.replay_tab import ReplayHandlers

SETTINGS = dict(budget=0.3, omega=8, q_frac=0.7, bits=2, sinks=5, recent=32, scorer="cumulative", promotion=True)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30 + "What jumps?"


def request(prompt=LONG_PROMPT, methods=("fullkv", "snapkv", "qevict"), max_new=24, **overrides):
    return parse_request(Controls.lanes(list(methods), prompt=prompt, **{**SETTINGS, **overrides},
                                        max_new_tokens=max_new))


def feed(view, data):
    """Fold a hand-written event into ``view``, a routing event on its lane's grid."""
    if data["kind"] == "routing":
        data = {"sinks": view.sinks(data["lane"]), "omega": view.omega(data["lane"]), **data}
    return view.apply(event_from_dict(data))


def diagnostics_text(studio, session_id):
    """What the Replay tab's diagnostics button shows for ``session_id``."""
    return ReplayHandlers(studio, TabRuns()).run_diagnostics(session_id)
