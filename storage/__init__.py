"""Persistence of studio runs: one narrow class over SQLAlchemy 2.x (SQLite by default, PostgreSQL by URL)."""

from .db import make_engine
from .store import SessionStore

__all__ = ["SessionStore", "make_engine"]
