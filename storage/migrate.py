"""Stored sessions brought to the current shape of a request, once: at start-up for the database
(``SessionStore.migrate``), on import for a file exported before (format ``qevict-session/1``).

The current shape (``qevict-session/3``): every lane names a registered method and carries the whole config it ran
with, ``kv_dtype`` included, and every routing event carries its window grid (sinks, Ω). Older sessions differ in
four ways, each rewritten here and nowhere else:

- a lane names a method since removed (``RETIRED``): it becomes the method that runs it now, with the config fields
  the old name stood for;
- a lane has no config (sessions stored before lanes kept theirs): it gets the form's, with its method's fields;
- a config has no ``kv_dtype`` (runs before caches were stored in 16 bits): ``"model"``, the dtype those runs
  stored keys and values in;
- a routing event has no ``sinks``/``omega`` (format 2 and before): its lane's.

``upgrade_request`` and ``upgrade_event`` are idempotent: a current request or event comes back equal, so running
the migration twice changes nothing the second time. Malformed parts are left as they are, for the schema to refuse
with its message.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from sqlalchemy import Text, select, type_coerce, update
from sqlalchemy.engine import Engine

from qevict_core import QEvictConfig
from qevict_core.registry import METHODS

FORMAT = "qevict-session/3"
OLDER_FORMATS = ("qevict-session/1", "qevict-session/2")
BEFORE_16_BIT = {"kv_dtype": "model"}  # what a config without kv_dtype ran with

# Removed methods: name -> (the method that runs it now, the config fields it set on top of that method's).
RETIRED: dict[str, tuple[str, dict[str, Any]]] = {
    "qevict_int4": ("qevict", dict(bits=4, scale_dtype="model", coverage=None, pool=0, pool_weight=1.0,
                                   pool_direction="both")),
    "qevict_int4_f16scale": ("qevict", dict(bits=4, scale_dtype="float16", coverage=None, pool=0, pool_weight=1.0,
                                            pool_direction="both")),
    "qevict_cover": ("qevict", dict(bits=4, scale_dtype="float16", coverage=0.7, pool=0, pool_weight=1.0,
                                    pool_direction="both")),
    "qevict_pool": ("qevict", dict(pool=1, pool_weight=1.0, pool_direction="both")),
    "qevict_head_pool": ("qevict_head", dict(pool=1, pool_weight=1.0, pool_direction="both", head_floor=0.2)),
    "qevict_head_nopool": ("qevict_head", dict(pool=0, head_floor=0.2)),
    "qevict_head_own": ("qevict_head", dict(pool=0, head_floor=0.2, head_blend=0.0)),
}


def upgrade_request(request: Any) -> Any:
    """``request`` in the current shape (a copy; ``request`` itself when nothing needed changing or it is not a
    request at all)."""
    if not isinstance(request, dict) or not isinstance(request.get("config"), dict) \
            or not isinstance(request.get("lanes"), list):
        return request
    new = copy.deepcopy(request)
    form = {**BEFORE_16_BIT, **new["config"]}
    new["config"] = form
    for lane in new["lanes"]:
        if not isinstance(lane, dict) or not isinstance(lane.get("method"), str):
            continue
        method, changes = RETIRED.get(lane["method"], (lane["method"], {}))
        config = lane.get("config")
        if config is None and method in METHODS:
            try:
                config = METHODS[method].lane_config(QEvictConfig.from_dict(form)).replace(**changes).to_dict()
            except ValueError:  # a form the schema refuses: left for its message
                continue
        elif isinstance(config, dict):
            config = {**BEFORE_16_BIT, **config, **changes}
        lane["method"], lane["config"] = method, config
    return request if new == request else new


def lane_grids(request: Any) -> dict[str, dict[str, int]]:
    """Lane name -> its window grid ({"sinks", "omega"}) from an upgraded request's lane configs."""
    grids = {}
    for lane in request.get("lanes", []) if isinstance(request, dict) else []:
        config = lane.get("config") if isinstance(lane, dict) else None
        if isinstance(config, dict) and isinstance(config.get("sinks"), int) and isinstance(config.get("omega"), int):
            grids[lane.get("name")] = {"sinks": config["sinks"], "omega": config["omega"]}
    return grids


def upgrade_event(event: Any, grids: dict[str, dict[str, int]]) -> Any:
    """A routing event with its lane's grid (a copy; ``event`` itself when it has one or is not a routing event)."""
    if not isinstance(event, dict) or event.get("kind") != "routing" or "omega" in event:
        return event
    return {**event, **grids.get(event.get("lane"), {})}


def upgrade_document(doc: Any) -> Any:
    """An export of an older format in the current one (its request and events upgraded); anything else as it is."""
    if not isinstance(doc, dict) or doc.get("format") not in OLDER_FORMATS:
        return doc
    doc = {**doc, "format": FORMAT}
    session = doc.get("session")
    if isinstance(session, dict):
        doc["session"] = {**session, "request": upgrade_request(session.get("request"))}
        grids = lane_grids(doc["session"]["request"])
        if isinstance(doc.get("events"), list):
            doc["events"] = [upgrade_event(event, grids) for event in doc["events"]]
    return doc


def migrate(engine: Engine) -> int:
    """Rewrite every stored session that is not in the current shape (its request, its routing events without a
    grid); -> how many sessions were rewritten."""
    from .db import EventRow, SessionRow

    changed = set()
    with engine.begin() as conn:
        requests = {}
        for session_id, raw in conn.execute(select(SessionRow.id, type_coerce(SessionRow.request, Text))):
            try:  # read as text: one row edited by hand into invalid JSON must not stop the others (or the app)
                request = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                continue
            upgraded = upgrade_request(request)
            if upgraded is not request:
                conn.execute(update(SessionRow).where(SessionRow.id == session_id).values(request=upgraded))
                changed.add(session_id)
            requests[session_id] = upgraded
        # Only routing rows without a grid come back: on a current database the scan returns none.
        stale = conn.execute(select(EventRow.id, EventRow.session_id, type_coerce(EventRow.payload, Text))
                             .where(EventRow.kind == "routing", EventRow.payload["omega"].as_integer().is_(None)))
        grids: dict[str, dict] = {}
        for row_id, session_id, raw in stale.all():
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if session_id not in grids:
                grids[session_id] = lane_grids(requests.get(session_id))
            upgraded = upgrade_event(event, grids[session_id])
            if upgraded is not event:
                conn.execute(update(EventRow).where(EventRow.id == row_id).values(payload=upgraded))
                changed.add(session_id)
    return len(changed)
