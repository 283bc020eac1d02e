"""``SessionStore``: create, stream into, finish, list, replay, export/import and delete studio sessions.

Session ids are 128-bit random (unguessable share links); deleting needs the separate token given to the creator,
stored only as a SHA-256 hash. Events are written as they stream, so an interrupted run stays replayable.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime
from typing import Any, Iterable

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from .db import EventRow, SessionRow, utcnow

EXPORT_FORMAT = "qevict-session/1"
STATUSES = ("running", "done", "stopped", "error")


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    # -- writing --------------------------------------------------------------------------------------------
    def create(self, prompt: str, request: dict[str, Any], status: str = "running") -> tuple[str, str]:
        """-> (session id, delete token). The token is returned once and only its hash is kept."""
        session_id, token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        with self._sessions.begin() as db:
            db.add(SessionRow(id=session_id, delete_token_hash=_hash(token), status=status,
                              title=" ".join(prompt.split())[:120], prompt=prompt, request=request, summary={}))
        return session_id, token

    def append(self, session_id: str, events: Iterable[dict[str, Any]]) -> int:
        rows = list(events)
        if not rows:
            return 0
        with self._sessions.begin() as db:
            start = db.scalar(select(func.coalesce(func.max(EventRow.seq), -1))
                              .where(EventRow.session_id == session_id)) + 1
            db.execute(insert(EventRow), [
                {"session_id": session_id, "seq": start + i, "step": int(e.get("step", 0)),
                 "lane": str(e.get("lane", "")), "kind": str(e["kind"]), "payload": e}
                for i, e in enumerate(rows)])
            db.get(SessionRow, session_id).updated_at = utcnow()
        return len(rows)

    def finish(self, session_id: str, status: str, summary: dict[str, Any]) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES} (got {status!r})")
        with self._sessions.begin() as db:
            row = db.get(SessionRow, session_id)
            row.status, row.summary = status, summary

    def delete(self, session_id: str, token: str) -> bool:
        with self._sessions.begin() as db:
            row = db.get(SessionRow, session_id)
            if row is None or not hmac.compare_digest(row.delete_token_hash, _hash(token or "")):
                return False
            db.execute(delete(EventRow).where(EventRow.session_id == session_id))
            db.delete(row)
        return True

    # -- reading --------------------------------------------------------------------------------------------
    def get(self, session_id: str) -> dict[str, Any] | None:
        with self._sessions() as db:
            row = db.get(SessionRow, session_id)
            return _meta(row) if row is not None else None

    def events(self, session_id: str, upto_step: int | None = None) -> list[dict[str, Any]]:
        query = select(EventRow.payload).where(EventRow.session_id == session_id)
        if upto_step is not None:
            query = query.where(EventRow.step <= upto_step)
        with self._sessions() as db:
            return list(db.scalars(query.order_by(EventRow.seq)))

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        with self._sessions() as db:
            rows = db.scalars(select(SessionRow).order_by(SessionRow.created_at.desc()).limit(limit))
            return [_meta(row) for row in rows]

    # -- exchange -------------------------------------------------------------------------------------------
    def export(self, session_id: str) -> dict[str, Any]:
        meta = self.get(session_id)
        if meta is None:
            raise KeyError(f"no such session: {session_id}")
        return {"format": EXPORT_FORMAT, "session": meta, "events": self.events(session_id)}

    def import_session(self, data: dict[str, Any]) -> tuple[str, str]:
        """Store an exported session under a new id -> (id, delete token)."""
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise ValueError(f"not a QEvict session export (expected format {EXPORT_FORMAT!r})")
        meta, events = data.get("session") or {}, data.get("events")
        if not isinstance(meta.get("prompt"), str) or not isinstance(events, list):
            raise ValueError("session export is missing its prompt or events")
        status = meta.get("status") if meta.get("status") in STATUSES else "done"
        session_id, token = self.create(meta["prompt"], meta.get("request") or {}, status=status)
        self.append(session_id, events)
        self.finish(session_id, status, meta.get("summary") or {})
        return session_id, token


def _meta(row: SessionRow) -> dict[str, Any]:
    return {"id": row.id, "created_at": _iso(row.created_at), "updated_at": _iso(row.updated_at),
            "status": row.status, "title": row.title, "prompt": row.prompt, "request": row.request,
            "summary": row.summary}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
