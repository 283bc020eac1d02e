"""SessionStore: round trips, deletion rights, unguessable ids, SQLite settings."""

import pytest
from sqlalchemy import text

from storage import SessionStore, make_engine


@pytest.fixture
def store(tmp_path):
    return SessionStore(make_engine(f"sqlite:///{tmp_path}/sessions.sqlite"))


EVENTS = [{"kind": "token", "lane": "a", "step": i, "token_id": i, "text": f"t{i}", "seconds": 0.1} for i in range(5)]


def test_save_load_export_import_round_trip(store):
    sid, token = store.create("prompt <b>text</b>", {"lanes": [{"name": "a", "method": "fullkv"}], "config": {}})
    assert store.get(sid)["status"] == "running"
    store.append(sid, EVENTS[:3])
    store.append(sid, EVENTS[3:])
    store.finish(sid, "done", {"lanes": {"a": {"tokens": 5}}})
    assert store.events(sid) == EVENTS
    assert store.events(sid, upto_step=2) == EVENTS[:3]
    exported = store.export(sid)
    new_id, new_token = store.import_session(exported)
    assert new_id != sid and new_token != token
    again = store.export(new_id)
    assert again["events"] == exported["events"]
    for key in ("prompt", "request", "status", "summary", "title"):
        assert again["session"][key] == exported["session"][key]
    assert [s["id"] for s in store.list()] == [new_id, sid]


def test_delete_needs_the_creators_token(store):
    sid, token = store.create("p", {})
    store.append(sid, EVENTS)
    assert not store.delete(sid, "")
    assert not store.delete(sid, "wrong")
    assert not store.delete("unknown", token)
    assert store.get(sid) is not None
    assert store.delete(sid, token)
    assert store.get(sid) is None and store.events(sid) == []


def test_ids_are_unguessable(store):
    ids = {store.create("p", {})[0] for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) >= 22 for i in ids)  # 16 random bytes, url-safe base64 = 128 bits


def test_import_rejects_what_is_not_an_export(store):
    with pytest.raises(ValueError, match="not a QEvict session export"):
        store.import_session({"format": "other"})
    with pytest.raises(ValueError, match="missing its prompt or events"):
        store.import_session({"format": "qevict-session/1", "session": {}, "events": []})
    assert store.list() == []


def test_sqlite_runs_in_wal_mode_with_foreign_keys(store):
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_bad_status_is_refused(store):
    sid, _ = store.create("p", {})
    with pytest.raises(ValueError, match="status must be one of"):
        store.finish(sid, "great", {})
