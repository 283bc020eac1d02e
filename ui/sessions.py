"""A visitor's own sessions: ids and delete tokens kept in their browser (``gr.BrowserState``), never listed from
the server. What the browser sends back is untrusted like any input: malformed entries are dropped."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from storage import SessionStore

MAX_OWNED = 200
STORAGE_KEY = "qevict-sessions"
Text = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class SessionRef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    id: Text
    token: Text


def refs(state: Any) -> list[dict[str, str]]:
    """The well-formed entries of a browser's list, newest first, at most ``MAX_OWNED``."""
    out, seen = [], set()
    for item in state if isinstance(state, list) else []:
        try:
            ref = SessionRef.model_validate(item)
        except ValidationError:
            continue
        if ref.id not in seen:
            seen.add(ref.id)
            out.append({"id": ref.id, "token": ref.token})
    return out[:MAX_OWNED]


def add(state: Any, session_id: str, token: str) -> list[dict[str, str]]:
    return refs([{"id": session_id, "token": token}] + refs(state))


def remove(state: Any, session_id: str) -> list[dict[str, str]]:
    return [ref for ref in refs(state) if ref["id"] != session_id]


def token_for(state: Any, session_id: str) -> str | None:
    return next((ref["token"] for ref in refs(state) if ref["id"] == session_id), None)


SESSION_HEADERS = ["id", "created (UTC)", "status", "lanes", "prompt"]


def count_label(count: int) -> str:
    return f"{count} run{'s' if count != 1 else ''} saved in this browser" if count else "No runs saved in this browser yet"


def rows(store: SessionStore, state: Any) -> list[list[str]]:
    """Table rows for the sessions this browser made or imported; one odd row never hides the others."""
    out = []
    for meta in store.owned(ref["id"] for ref in refs(state)):
        try:
            lanes = ", ".join(str(lane["name"]) for lane in meta["request"]["lanes"])
        except (KeyError, TypeError):
            lanes = "(unreadable)"
        out.append([meta["id"], (meta["created_at"] or "")[:19].replace("T", " "), str(meta["status"]), lanes,
                    str(meta["title"])[:80]])
    return out
