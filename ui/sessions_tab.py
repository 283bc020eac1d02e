"""What the Sessions tab's controls do: this browser's runs listed, opened, exported, imported and deleted (named
inputs and outputs, as ``run_tab``)."""

from __future__ import annotations

import json
import os
import tempfile

import gradio as gr

from storage.schema import max_import_bytes

from . import sessions
from .outputs import LoadOutputs, OpenOutputs, Shown
from .replay_tab import ReplayHandlers


class SessionHandlers:
    def __init__(self, replay: ReplayHandlers):
        self.replay, self.store = replay, replay.studio.store

    def list_sessions(self, owned):
        """The table of this browser's runs, its label saying how many (an empty table reads as "none", not as
        "not loaded yet")."""
        listed = sessions.rows(self.store, owned)
        return gr.update(value=listed, label=sessions.count_label(len(listed)))

    def pick_row(self, evt: gr.SelectData):
        return evt.row_value[0] if evt.row_value else gr.skip()

    def open_session(self, session_id: str, shown: Shown, request: gr.Request) -> OpenOutputs:
        return OpenOutputs(gr.Tabs(selected="replay"), session_id,
                           self.replay.show_replay(session_id, None, shown, request))

    def export_session(self, session_id: str):
        """-> (the download box, shown only with a file in it, and a status line)."""
        session_id = (session_id or "").strip()
        if self.store.get(session_id) is None:
            return gr.update(value=None, visible=False), f"**No such session:** `{session_id[:64]}`"
        path = os.path.join(tempfile.mkdtemp(prefix="qevict-"), f"qevict-session-{session_id}.json")
        with open(path, "w") as handle:
            json.dump(self.store.export(session_id), handle)
        return gr.update(value=path, visible=True), f"Exported `{session_id}`: download it below."

    def import_session(self, upload, owned):
        """-> (the status line, this browser's list with the new run)."""
        if upload is None:  # cleared, or a file the browser refused: no earlier file's reason stays on screen
            return "", gr.skip()
        path = upload if isinstance(upload, str) else upload.name
        try:
            if os.path.getsize(path) > max_import_bytes():
                raise ValueError(f"the file is larger than the import limit of {max_import_bytes() / 2**20:.0f} MiB")
            with open(path, "rb") as handle:
                new_id, token = self.store.import_session(handle.read())
        except ValueError as err:
            return f"**Import refused, nothing was stored:** {err}", gr.skip()
        return (f"Imported as `{new_id}` — listed above; open it with **Open in Replay**.",
                sessions.add(owned, new_id, token))

    def ask_delete(self, session_id: str):
        """Delete asks first: -> (the confirm button, the status line)."""
        session_id = (session_id or "").strip()
        if not session_id:
            return gr.update(visible=False), "Pick a session first (click a row)."
        return (gr.update(visible=True),
                f"Delete `{session_id[:64]}` for good? Its share link stops working. **Confirm delete** to go on.")

    def delete_session(self, session_id: str, token: str, owned):
        """-> (the status line, this browser's list without it, the confirm button hidden)."""
        session_id = (session_id or "").strip()
        token = sessions.token_for(owned, session_id) or (token or "")
        if self.store.delete(session_id, token):
            return "Deleted.", sessions.remove(owned, session_id), gr.update(visible=False)
        return "**Not deleted:** unknown session id or wrong delete token.", gr.skip(), gr.update(visible=False)

    def on_load(self, shown: Shown, owned, request: gr.Request) -> LoadOutputs:
        """A share link (``?session=``) opens its run in Replay (in presentation mode with ``&present=1``); the
        Sessions table lists this browser's runs."""
        listed = self.list_sessions(owned)
        query = request.query_params if request is not None else {}
        present = True if query.get("present") in ("1", "true") else gr.skip()
        session_id = query.get("session")
        if not session_id:
            return LoadOutputs(table=listed, present=present)
        return LoadOutputs(**vars(self.open_session(session_id, shown, request)), table=listed, present=present)
