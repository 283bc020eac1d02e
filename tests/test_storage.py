"""SessionStore on SQLite and on a real PostgreSQL server: round trips, deletion rights, unguessable ids, imports
validated and applied atomically, crash recovery, and no listing of sessions a caller does not name."""

import copy
import json

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import StatementError

from qevict_core import QEvictConfig
from storage import SessionStore, make_engine
from storage.db import EventRow, SessionRow
from storage.migrate import FORMAT
from storage.schema import parse_document

REQUEST = {"model": "tiny", "lanes": [{"name": "fullkv", "method": "fullkv", "config": QEvictConfig().to_dict()},
                                      {"name": "qevict", "method": "qevict", "config": QEvictConfig().to_dict()}],
           "config": QEvictConfig().to_dict(), "sampling": {"max_new_tokens": 8, "temperature": 0.0, "seed": 0},
           "prompt_length": 3, "prompt_tokens": ["a", "b", "c"], "prompt_span": [0, 3]}
GRID = {"sinks": QEvictConfig().sinks, "omega": QEvictConfig().omega}
ROUTING = {"kind": "routing", "lane": "qevict", "step": 4, "layer": 0, "head": None, "seen": 7, "recent_start": 7,
           **GRID, "full": [], "quantized": [0], "promoted": [], "demoted": [], "evicted": [],
           "admitted": {"0": "quantized"}, "scores": {"0": 0.5}}
EVENTS = [{"kind": "token", "lane": lane, "step": i, "token_id": i, "text": f"t{i}", "seconds": 0.1}
          for i in range(5) for lane in ("fullkv", "qevict")] + [ROUTING]


@pytest.fixture
def store(database_url):
    return SessionStore(make_engine(database_url))


def export_doc(**session_changes):
    return {"format": FORMAT, "session": {"prompt": "a prompt", "request": copy.deepcopy(REQUEST),
                                                       **session_changes}, "events": copy.deepcopy(EVENTS)}


def count_rows(store):
    with store.engine.connect() as conn:
        return (conn.scalar(select(func.count()).select_from(SessionRow)),
                conn.scalar(select(func.count()).select_from(EventRow)))


def test_save_load_export_import_round_trip(store):
    sid, token = store.create("prompt <b>text</b>", REQUEST)
    assert store.get(sid)["status"] == "running"
    store.append(sid, EVENTS[:3])
    store.append(sid, EVENTS[3:])
    store.finish(sid, "done", {"lanes": {}})
    assert store.events(sid) == EVENTS
    assert store.events(sid, upto_step=1) == [e for e in EVENTS if e["step"] <= 1]
    exported = json.loads(json.dumps(store.export(sid)))
    new_id, new_token = store.import_session(json.dumps(exported).encode())
    assert new_id != sid and new_token != token
    again = store.export(new_id)
    assert again["events"] == exported["events"]
    assert again["session"]["prompt"] == exported["session"]["prompt"]
    assert again["session"]["request"] == exported["session"]["request"]
    assert again["session"]["status"] == "imported"  # never "running", whatever the file said
    assert [s["id"] for s in store.owned([sid, new_id])] == [new_id, sid]


def test_only_named_sessions_are_listed(store):
    mine = store.create("mine", REQUEST)[0]
    store.create("someone else's", REQUEST)
    assert [s["title"] for s in store.owned([mine, "made-up-id", 5])] == ["mine"]
    assert store.owned([]) == []
    assert not hasattr(store, "list")  # nothing enumerates every session


def test_an_unreadable_row_does_not_hide_the_others(tmp_path):
    store = SessionStore(make_engine(f"sqlite:///{tmp_path}/hand-edited.sqlite"))
    good, _ = store.create("good", REQUEST)
    bad, _ = store.create("bad", REQUEST)
    with store.engine.begin() as conn:  # edited by hand, or by an older version
        conn.execute(text("UPDATE sessions SET request = '{not json' WHERE id = :id"), {"id": bad})
    listed = {s["id"]: s for s in store.owned([good, bad])}
    assert listed[good]["request"] == REQUEST and listed[bad]["request"] is None
    with pytest.raises(ValueError):
        store.get(bad)


def test_delete_needs_the_creators_token(store):
    sid, token = store.create("p", REQUEST)
    store.append(sid, EVENTS)
    assert not store.delete(sid, "")
    assert not store.delete(sid, "wrong")
    assert not store.delete("unknown", token)
    assert store.get(sid) is not None
    assert store.delete(sid, token)
    assert store.get(sid) is None and store.events(sid) == []


def test_ids_are_unguessable(store):
    ids = {store.create("p", REQUEST)[0] for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) >= 22 for i in ids)  # 16 random bytes, url-safe base64 = 128 bits


POISONED = [
    # The import that broke every page: a lane name that is not a string, a request missing its parts.
    ({"format": "qevict-session/1", "session": {"prompt": "x", "request": {
        "lanes": [{"name": 5, "method": "fullkv"}], "config": {"sinks": 5, "omega": 8}}}, "events": []},
     "session.request.lanes.0.name"),
    ({**export_doc(), "events": [1, 2, 3]}, "events.0"),
    ({**export_doc(), "events": [{**EVENTS[0], "step": "abc"}]}, "events.0.token.step"),
    ({**export_doc(), "session": "notadict"}, "session"),
    (export_doc(request={}), "session.request"),
    ({**export_doc(), "format": "other"}, "format"),
    ({**export_doc(), "events": [{**EVENTS[0], "lane": "snapkv"}]}, "belongs to lane 'snapkv'"),
    ({**export_doc(), "events": EVENTS + [{**EVENTS[0], "step": 8}]}, "beyond max_new_tokens=8"),
    ({**export_doc(), "events": EVENTS + [{**EVENTS[0], "seconds": float("nan")}]}, "finite number"),
    (export_doc(request={**REQUEST, "lanes": [{"name": "x", "method": "magic", "config": {}}]}),
     "unknown method 'magic'"),
    (export_doc(request={**REQUEST, "lanes": [{"name": "x", "method": "qevict", "config": {"omega": 8}}]}),
     "must say its kv_dtype"),
    (export_doc(request={**REQUEST, "config": {"omega": 0}}), "omega must be an integer >= 1"),
    (export_doc(request={**REQUEST, "sampling": {"max_new_tokens": 8, "temperature": 1e999, "seed": 0}}),
     "finite number"),
    (export_doc(prompt=""), "session.prompt"),
]


@pytest.mark.parametrize("doc, message", POISONED, ids=range(len(POISONED)))
def test_a_bad_import_is_refused_whole_with_a_message(store, doc, message):
    store.create("already there", REQUEST)
    before = count_rows(store)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as refused:
        store.import_session(json.dumps(doc).encode())
    assert count_rows(store) == before  # nothing half-stored
    assert not any(kind in str(refused.value) for kind in ("Value error,", "Assertion failed,", "got None"))


def test_an_import_over_the_size_limit_is_refused(store, monkeypatch):
    monkeypatch.setenv("QEVICT_IMPORT_MAX_MB", "0.001")  # ~1 KB
    with pytest.raises(ValueError, match="larger than the import limit"):
        store.import_session(json.dumps(export_doc()).encode())
    assert count_rows(store) == (0, 0)


def test_sessions_cut_off_by_a_crash_are_marked_interrupted(store):
    running, _ = store.create("was running", REQUEST)
    store.append(running, EVENTS[:4])
    finished, _ = store.create("finished", REQUEST)
    store.finish(finished, "done", {})
    assert store.mark_interrupted() == 1
    assert store.get(running)["status"] == "interrupted" and store.get(finished)["status"] == "done"
    assert store.events(running) == EVENTS[:4]  # what was written stays replayable
    # A run still alive on another replica flips back at its next write.
    store.append(running, EVENTS[4:6])
    assert store.get(running)["status"] == "running"


def test_non_finite_numbers_never_reach_the_database(store):
    with pytest.raises(ValueError, match="finite number"):
        store.create("p", {**REQUEST, "sampling": {"max_new_tokens": 8, "temperature": float("nan"), "seed": 0}})
    sid, _ = store.create("p", REQUEST)
    with pytest.raises(ValueError, match="malformed events"):
        store.append(sid, [{**EVENTS[0], "seconds": float("inf")}])
    with pytest.raises((ValueError, StatementError), match="not JSON compliant"):  # past the schema too
        store.finish(sid, "done", {"x": float("nan")})
    assert store.get(sid)["summary"] == {}


def test_bad_status_is_refused(store):
    sid, _ = store.create("p", REQUEST)
    for status in ("great", "running", "imported"):
        with pytest.raises(ValueError, match="a run finishes as one of"):
            store.finish(sid, status, {})


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path):
    store = SessionStore(make_engine(f"sqlite:///{tmp_path}/wal.sqlite"))
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


# A request as the studio stored it before lanes kept their configs and before 16-bit caches, naming a method since
# removed: what the migration and the import of a format-1 file must bring to the current shape.
OLD_FORM = {k: v for k, v in QEvictConfig(budget=0.3, bits=2).to_dict().items() if k != "kv_dtype"}
OLD_REQUEST = {**REQUEST, "config": OLD_FORM,
               "lanes": [{"name": "fullkv", "method": "fullkv"}, {"name": "qevict_cover", "method": "qevict_cover"}]}


def old_events():
    """EVENTS as format 1 stored them: the retired lane name, routing events without their grid."""
    renamed = [{**e, "lane": e["lane"].replace("qevict", "qevict_cover")} for e in EVENTS]
    return [{k: v for k, v in e.items() if k not in GRID} if e["kind"] == "routing" else e for e in renamed]


def assert_upgraded(request):
    fullkv, cover = request["lanes"]
    assert request["config"]["kv_dtype"] == "model"  # what those runs stored keys and values in
    assert fullkv["config"]["kv_dtype"] == cover["config"]["kv_dtype"] == "model"
    # the retired name runs as what it became, with the fields it stood for over the session's form
    assert cover["name"] == "qevict_cover" and cover["method"] == "qevict"
    assert (cover["config"]["coverage"], cover["config"]["bits"], cover["config"]["budget"]) == (0.7, 4, 0.3)


def test_an_old_database_is_migrated_once(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path}/old.sqlite")
    with engine.begin() as conn:  # rows as an earlier version wrote them, past today's checks
        for sid, request in (("old", OLD_REQUEST), ("new", REQUEST)):
            conn.execute(SessionRow.__table__.insert().values(
                id=sid, delete_token_hash="x", status="done", title=sid, prompt="p", request=request, summary={}))
        conn.execute(SessionRow.__table__.insert().values(
            id="broken", delete_token_hash="x", status="done", title="b", prompt="p", request={}, summary={}))
        conn.execute(text("UPDATE sessions SET request = '{not json' WHERE id = 'broken'"))
        conn.execute(EventRow.__table__.insert(), [{"session_id": "old", "seq": i, "step": e["step"],
                                                    "lane": e["lane"].replace("qevict", "qevict_cover"),
                                                    "kind": e["kind"], "payload": e}
                                                   for i, e in enumerate(old_events())])
    store = SessionStore(engine)
    with pytest.raises(ValueError):  # before: today's schema cannot read it
        parse_document(store.export("old"))
    assert store.migrate() == 1  # the old row; the current one and the unreadable one are left
    assert store.migrate() == 0  # idempotent
    assert_upgraded(store.get("old")["request"])
    assert store.get("new")["request"] == REQUEST
    assert store.events("old")[-1] == {**ROUTING, "lane": "qevict_cover"}  # the lane's grid, from its config
    parse_document(store.export("old"))  # replayable: it fits today's schema whole


def test_a_format_1_export_is_imported_in_the_current_shape(store):
    doc = {"format": "qevict-session/1", "session": {"prompt": "p", "request": OLD_REQUEST}, "events": old_events()}
    new_id, _ = store.import_session(json.dumps(doc))
    exported = store.export(new_id)
    assert exported["format"] == FORMAT
    assert_upgraded(exported["session"]["request"])
    assert exported["events"][-1] == {**ROUTING, "lane": "qevict_cover"}


def test_a_format_2_export_gets_its_routing_grid_from_its_lanes(store):
    doc = export_doc()
    doc["format"], doc["events"][-1] = "qevict-session/2", {k: v for k, v in ROUTING.items() if k not in GRID}
    assert store.export(store.import_session(json.dumps(doc))[0])["events"] == EVENTS


def test_a_routing_event_on_another_grid_than_its_lane_is_refused(store):
    doc = export_doc()
    doc["events"][-1] = {**ROUTING, "omega": GRID["omega"] + 1}
    with pytest.raises(ValueError, match="window grid"):
        store.import_session(json.dumps(doc))
    assert count_rows(store) == (0, 0)
