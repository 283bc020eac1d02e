"""Engines and the schema: a session row per run, one event row per streamed event."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Index, Integer, String, Text, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

SPACE_STORAGE = Path("/data")  # a Hugging Face Space's persistent storage, when the Space has it


def default_url(persistent: Path = SPACE_STORAGE) -> str:
    """A SQLite file in ``persistent`` when that folder exists and is writable (a Space with persistent storage:
    sessions survive restarts), else under data/ beside the app."""
    if persistent.is_dir() and os.access(persistent, os.W_OK):
        return f"sqlite:///{persistent / 'qevict' / 'qevict.sqlite'}"
    return "sqlite:///data/qevict.sqlite"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON}


class SessionRow(Base):
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    delete_token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    status: Mapped[str] = mapped_column(String(16))  # see store.STATUSES
    title: Mapped[str] = mapped_column(String(200))
    prompt: Mapped[str] = mapped_column(Text)
    request: Mapped[dict[str, Any]]
    summary: Mapped[dict[str, Any]]


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_session_step", "session_id", "step"),
                      Index("ux_events_session_seq", "session_id", "seq", unique=True))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    lane: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    payload: Mapped[dict[str, Any]]


def make_engine(url: str | None = None) -> Engine:
    """``url`` or $DATABASE_URL or ``default_url()``; tables are created if missing."""
    url = url or os.environ.get("DATABASE_URL") or default_url()
    if url.startswith("postgres://"):  # Heroku-style URLs; SQLAlchemy wants the driver named
        url = "postgresql+psycopg://" + url[len("postgres://"):]
    kwargs: dict = {}
    if url.startswith("sqlite"):
        if url in ("sqlite://", "sqlite:///:memory:"):
            # Gradio runs handlers in threads: one shared in-memory connection, not one empty DB per thread.
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        else:
            path = url.split("///", 1)[-1]
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            kwargs = {"connect_args": {"check_same_thread": False}}
    # JSON has no NaN or infinity; writing one would make the row unreadable to SQL json functions and strict
    # readers, so the serializer refuses it and the write fails where the bad value was produced.
    engine = create_engine(url, json_serializer=partial(json.dumps, allow_nan=False), **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    Base.metadata.create_all(engine)
    return engine


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=5000"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()
