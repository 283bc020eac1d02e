"""Stored sessions brought to the current shape of a request, once: at start-up for the database
(``SessionStore.migrate``), on import for a file exported before (format ``qevict-session/1``).

The current shape (``qevict-session/2``): every lane names a registered method and carries the whole config it ran
with, ``kv_dtype`` included. Older sessions differ in three ways, each rewritten here and nowhere else:

- a lane names a method since removed (``RETIRED``): it becomes the method that runs it now, with the config fields
  the old name stood for;
- a lane has no config (sessions stored before lanes kept theirs): it gets the form's, with its method's fields;
- a config has no ``kv_dtype`` (runs before caches were stored in 16 bits): ``"model"``, the dtype those runs
  stored keys and values in.

``upgrade_request`` is idempotent: a current request comes back equal, so running the migration twice changes
nothing the second time. Malformed parts are left as they are, for the schema to refuse with its message.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from sqlalchemy import Text, select, type_coerce, update
from sqlalchemy.engine import Engine

from qevict_core import QEvictConfig
from qevict_core.registry import METHODS

FORMAT_V1, FORMAT = "qevict-session/1", "qevict-session/2"
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


def upgrade_document(doc: Any) -> Any:
    """An export of format 1 as format 2 (its request upgraded); anything else as it is."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_V1:
        return doc
    doc = {**doc, "format": FORMAT}
    session = doc.get("session")
    if isinstance(session, dict):
        doc["session"] = {**session, "request": upgrade_request(session.get("request"))}
    return doc


def migrate(engine: Engine) -> int:
    """Rewrite every stored request that is not in the current shape; -> how many were rewritten."""
    from .db import SessionRow

    changed = 0
    with engine.begin() as conn:
        for session_id, raw in conn.execute(select(SessionRow.id, type_coerce(SessionRow.request, Text))):
            try:  # read as text: one row edited by hand into invalid JSON must not stop the others (or the app)
                request = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                continue
            upgraded = upgrade_request(request)
            if upgraded is not request:
                conn.execute(update(SessionRow).where(SessionRow.id == session_id).values(request=upgraded))
                changed += 1
    return changed
