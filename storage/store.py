"""``SessionStore``: create, stream into, finish, replay, export/import and delete studio sessions.

Session ids are 128-bit random (unguessable share links); deleting needs the separate token given to the creator,
stored only as a SHA-256 hash. Nothing here lists sessions a caller does not name: a visitor's own list lives in
their browser. Every request and event is checked against ``storage.schema`` before it is written, and an import
is written in one transaction, so a row either fits the schema or does not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from datetime import datetime
from typing import Any, Iterable

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import Text, case, delete, func, insert, select, type_coerce, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from .db import EventRow, SessionRow, utcnow
from .schema import EXPORT_FORMAT, EventDoc, RequestSpec, describe, max_import_bytes, parse_document

# running: being generated; interrupted: the server stopped while it ran (found at start-up); imported: from a file.
STATUSES = ("running", "done", "stopped", "error", "interrupted", "imported")
FINAL = ("done", "stopped", "error")
MAX_OWNED = 200
_EVENTS = TypeAdapter(list[EventDoc])


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _title(prompt: str) -> str:
    return " ".join(prompt.split())[:120]


class SessionStore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    # -- writing --------------------------------------------------------------------------------------------
    def create(self, prompt: str, request: dict[str, Any]) -> tuple[str, str]:
        """-> (session id, delete token) of a new running session. The token is returned once; its hash is kept."""
        _check_request(request)
        session_id, token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        with self._sessions.begin() as db:
            db.add(SessionRow(id=session_id, delete_token_hash=_hash(token), status="running", title=_title(prompt),
                              prompt=prompt, request=request, summary={}))
        return session_id, token

    def append(self, session_id: str, events: Iterable[dict[str, Any]]) -> int:
        rows = list(events)
        if not rows:
            return 0
        try:
            _EVENTS.validate_python(rows)
        except ValidationError as err:
            raise ValueError(f"refusing to store malformed events: {describe(err)}") from None
        with self._sessions.begin() as db:
            self._insert_events(db, session_id, rows)
            # A run that writes is alive: undo "interrupted" if another replica's start-up marked it so.
            db.execute(update(SessionRow).where(SessionRow.id == session_id)
                       .values(updated_at=utcnow(), status=_revive(SessionRow.status)))
        return len(rows)

    def finish(self, session_id: str, status: str, summary: dict[str, Any]) -> None:
        if status not in FINAL:
            raise ValueError(f"a run finishes as one of {FINAL} (got {status!r})")
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

    def migrate(self) -> int:
        """At start-up: stored sessions brought to the current shape of a request (storage/migrate.py), once;
        -> how many were rewritten (0 the second time)."""
        from .migrate import migrate

        return migrate(self.engine)

    def mark_interrupted(self) -> int:
        """At start-up: sessions still "running" were cut off by a crash or restart. -> how many."""
        with self._sessions.begin() as db:
            return db.execute(update(SessionRow).where(SessionRow.status == "running")
                              .values(status="interrupted")).rowcount

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

    def owned(self, session_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The named sessions that exist, newest first (a visitor's list, from the ids their browser keeps): id,
        created_at, status, title and request, which is None when its stored JSON cannot be read. Requests are
        decoded row by row, so one unreadable row cannot hide the others."""
        ids = [i for i in dict.fromkeys(session_ids) if isinstance(i, str)][:MAX_OWNED]
        if not ids:
            return []
        query = (select(SessionRow.id, SessionRow.created_at, SessionRow.status, SessionRow.title,
                        type_coerce(SessionRow.request, Text))
                 .where(SessionRow.id.in_(ids)).order_by(SessionRow.created_at.desc()))
        with self._sessions() as db:
            return [{"id": sid, "created_at": _iso(created), "status": status, "title": title,
                     "request": _decoded(request)} for sid, created, status, title, request in db.execute(query)]

    # -- exchange -------------------------------------------------------------------------------------------
    def export(self, session_id: str) -> dict[str, Any]:
        meta = self.get(session_id)
        if meta is None:
            raise KeyError(f"no such session: {session_id}")
        return {"format": EXPORT_FORMAT, "session": meta, "events": self.events(session_id)}

    def import_session(self, raw: bytes | str | dict[str, Any]) -> tuple[str, str]:
        """Validate an export (ValueError saying what is wrong) and store it whole, in one transaction, under a
        new id with status "imported" -> (id, delete token)."""
        if isinstance(raw, (bytes, str)) and len(raw) > max_import_bytes():
            raise ValueError(f"the file is {len(raw) / 2**20:.1f} MiB, larger than the import limit of "
                             f"{max_import_bytes() / 2**20:.1f} MiB")
        doc = parse_document(raw)
        request = doc.session.request.model_dump(mode="json", exclude_unset=True)
        events = [event.model_dump(mode="json", exclude_unset=True) for event in doc.events]
        session_id, token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        with self._sessions.begin() as db:
            db.add(SessionRow(id=session_id, delete_token_hash=_hash(token), status="imported",
                              title=_title(doc.session.prompt), prompt=doc.session.prompt, request=request,
                              summary={}))
            db.flush()
            self._insert_events(db, session_id, events)
        return session_id, token

    @staticmethod
    def _insert_events(db, session_id: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        start = db.scalar(select(func.coalesce(func.max(EventRow.seq), -1))
                          .where(EventRow.session_id == session_id)) + 1
        db.execute(insert(EventRow), [
            {"session_id": session_id, "seq": start + i, "step": e["step"], "lane": e["lane"], "kind": e["kind"],
             "payload": e} for i, e in enumerate(rows)])


def _check_request(request: dict[str, Any]) -> None:
    try:
        RequestSpec.model_validate(request)
    except ValidationError as err:
        raise ValueError(f"refusing to store a malformed request: {describe(err)}") from None


def _decoded(raw: Any) -> Any:
    if not isinstance(raw, str):  # drivers that decode JSON themselves (psycopg) hand over the value
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _revive(status):
    return case((status == "interrupted", "running"), else_=status)


def _meta(row: SessionRow) -> dict[str, Any]:
    return {"id": row.id, "created_at": _iso(row.created_at), "updated_at": _iso(row.updated_at),
            "status": row.status, "title": row.title, "prompt": row.prompt, "request": row.request,
            "summary": row.summary}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
