"""The declared shape of a stored session: what an import must be, and what a replay may assume.

Everything a visitor can send (an import file) and everything read back from the database passes through these
models, so one malformed document is refused with a message instead of reaching a page. Models are strict (no
"12" for 12), refuse unknown keys and non-finite numbers, and cap every size: a document is bounded in bytes
(``max_import_bytes``) and in the number of events, lanes, windows and characters it may hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from qevict_core import QEvictConfig
from qevict_core.events import EVENT_TYPES
from qevict_core.registry import METHODS

from .migrate import FORMAT as EXPORT_FORMAT, upgrade_document

MAX_LANES = 3
MAX_PROMPT_CHARS = 200_000
MAX_PROMPT_TOKENS = 131_072  # beyond any context the studio serves
MAX_NEW_TOKENS = 4096
MAX_EVENTS = 250_000
MAX_WINDOWS = 1_000_000


def max_import_bytes() -> int:
    """Import size limit: $QEVICT_IMPORT_MAX_MB (default 16 MiB, a 3-lane run of a few hundred tokens on 2K-token
    prompts exports ~1-3 MiB; the routing events of an 8K prompt are what make a document large)."""
    return int(float(os.environ.get("QEVICT_IMPORT_MAX_MB", "16")) * 2**20)


Finite = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(allow_inf_nan=False, ge=0, le=10**7)]
Count = Annotated[int, Field(ge=0, le=10**15)]
Step = Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)]
LaneName = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,40}(#[0-9]{1,2})?$")]
Window = Annotated[int, Field(ge=0, le=MAX_WINDOWS)]
WindowKey = Annotated[str, Field(pattern=r"^[0-9]{1,7}$")]
Windows = Annotated[list[Window], Field(max_length=MAX_WINDOWS)]
Key = Annotated[str, Field(min_length=1, max_length=40)]
STRICT = ConfigDict(strict=True, extra="forbid", frozen=True)


class LaneSpec(BaseModel):
    model_config = STRICT
    name: LaneName
    method: str
    budget_bytes: Annotated[int, Field(ge=1, le=10**15)] | None = None  # when the studio raised this lane's budget
    note: Annotated[str, Field(max_length=1000)] = ""
    config: dict[Key, Any]  # what the lane ran with, whole (older sessions are upgraded: storage/migrate.py)

    @field_validator("method")
    @classmethod
    def _known(cls, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown method {method[:40]!r}; allowed: {sorted(METHODS)}")
        return method

    @field_validator("config")
    @classmethod
    def _config(cls, config: dict) -> dict:
        QEvictConfig.from_dict(config)  # its own checks: types, ranges, finite numbers, known keys
        if "kv_dtype" not in config:  # the one field whose default changed what a run stored
            raise ValueError("a lane's config must say its kv_dtype (what its cache stored keys and values in)")
        return config


class SamplingSpec(BaseModel):
    model_config = STRICT
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0, le=10)]
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)]


class RequestSpec(BaseModel):
    model_config = STRICT
    model: Annotated[str, Field(max_length=300)] = ""
    lanes: Annotated[list[LaneSpec], Field(min_length=1, max_length=MAX_LANES)]
    config: dict[Key, Any]
    sampling: SamplingSpec
    prompt_length: Annotated[int, Field(ge=1, le=MAX_PROMPT_TOKENS)]
    prompt_tokens: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_PROMPT_TOKENS)]
    prompt_span: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)] | None = None
    expected: Annotated[str, Field(max_length=200)] = ""  # the answer the prompt asks for, when known

    @field_validator("config")
    @classmethod
    def _config(cls, config: dict) -> dict:
        QEvictConfig.from_dict(config)  # its own checks: types, ranges, finite numbers, known keys
        return config

    @model_validator(mode="after")
    def _consistent(self) -> RequestSpec:
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"lane names must be unique (got {names})")
        if len(self.prompt_tokens) != self.prompt_length:
            raise ValueError(f"prompt_tokens has {len(self.prompt_tokens)} entries for prompt_length "
                             f"{self.prompt_length}")
        if self.prompt_span is not None and not self.prompt_span[0] <= self.prompt_span[1] <= self.prompt_length:
            raise ValueError(f"prompt_span {self.prompt_span} must lie within the prompt's {self.prompt_length} tokens")
        return self


Position = Annotated[int, Field(ge=0, le=10**7)]
# What a stored event's field may hold, by field name (a kind's own entry first). The fields themselves, their
# defaults and which are required come from the event classes (qevict_core/events.py); one without a bound here
# stops this module from loading.
BOUNDS: dict[str, Any] = {
    "lane": LaneName, "step": Step, "seconds": Seconds, "alone_seconds": Seconds | None,
    "token_id": Annotated[int, Field(ge=0, le=10**7)],
    "text": Annotated[str, Field(max_length=MAX_NEW_TOKENS * 64)],
    "total_bytes": Count, "fullkv_bytes": Count, "budget_bytes": Count | None, "peak_bytes": Count,
    "components": Annotated[dict[Key, Count], Field(max_length=32)],
    "tiers": Annotated[dict[Key, Count], Field(max_length=8)],
    "layer": Annotated[int, Field(ge=0, le=1024)], "head": Annotated[int, Field(ge=0, le=1024)] | None,
    "seen": Position, "recent_start": Position, "sinks": Position,
    "omega": Annotated[int, Field(ge=1, le=10**4)],
    "full": Windows, "quantized": Windows, "promoted": Windows, "demoted": Windows, "evicted": Windows,
    "admitted": Annotated[dict[WindowKey, Literal["full", "quantized", "evicted"]], Field(max_length=MAX_WINDOWS)],
    "scores": Annotated[dict[WindowKey, Finite | None], Field(max_length=MAX_WINDOWS)],
    "reason": Annotated[str, Field(max_length=2000)],
    "tokens": Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)],
    "prefill_seconds": Seconds, "decode_seconds": Seconds,
    "summary": Annotated[dict[Key, int | Finite | bool | None], Field(max_length=32)],
}
OWN_BOUNDS: dict[str, dict[str, Any]] = {"token": {"text": Annotated[str, Field(max_length=1000)]}}


def _stored_model(kind: str, cls: type) -> type[BaseModel]:
    """The bounded, strict model of ``cls``'s JSON form (``to_dict``)."""
    fields: dict[str, Any] = {"kind": (Literal[kind], ...)}
    for f in dataclasses.fields(cls):
        if f.name == "kind":
            continue
        bound = OWN_BOUNDS.get(kind, {}).get(f.name, BOUNDS.get(f.name))
        if bound is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no bound in storage.schema.BOUNDS")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = ...
        fields[f.name] = (bound, default)
    return create_model(f"Stored{cls.__name__}", __config__=STRICT, **fields)


EVENT_MODELS: dict[str, type[BaseModel]] = {kind: _stored_model(kind, cls) for kind, cls in EVENT_TYPES.items()}
EventDoc = Annotated[Union[tuple(EVENT_MODELS.values())], Field(discriminator="kind")]


class SessionSpec(BaseModel):
    """The session part of an export; status, ids, times and summary are the exporter's and are not kept."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    request: RequestSpec


class SessionDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    format: Literal[EXPORT_FORMAT]
    session: SessionSpec
    events: Annotated[list[EventDoc], Field(max_length=MAX_EVENTS)]

    @model_validator(mode="after")
    def _events_fit_the_request(self) -> SessionDocument:
        request = self.session.request
        lanes = {lane.name for lane in request.lanes}
        last = request.sampling.max_new_tokens - 1
        grids = {lane.name: (int(lane.config.get("sinks", 0)), int(lane.config.get("omega", 1)))
                 for lane in request.lanes}
        total = request.prompt_length + request.sampling.max_new_tokens
        for i, event in enumerate(self.events):
            if event.lane not in lanes:
                raise ValueError(f"event {i} belongs to lane {event.lane!r}, not one of {sorted(lanes)}")
            if event.step > last:
                raise ValueError(f"event {i} is at step {event.step}, beyond max_new_tokens={last + 1}")
            if event.kind == "routing":
                _check_routing(i, event, grids[event.lane], total)
        return self


def _check_routing(i: int, event: BaseModel, grid: tuple[int, int], total: int) -> None:
    """An event drawn on its lane's grid, within the session: its largest window id is that of the session's last
    token (prompt + new tokens), so no stored id can make a drawing larger than the run it shows."""
    if (event.sinks, event.omega) != grid:
        raise ValueError(f"event {i}: its window grid (sinks={event.sinks}, omega={event.omega}) is not its lane's "
                         f"(sinks={grid[0]}, omega={grid[1]})")
    if event.seen > total or event.recent_start > event.seen:
        raise ValueError(f"event {i}: seen={event.seen}, recent_start={event.recent_start} must satisfy "
                         f"recent_start <= seen <= {total} (the session's prompt + new tokens)")
    bound = max(0, (total - 1 - event.sinks) // event.omega)
    ids = [*event.full, *event.quantized, *event.promoted, *event.demoted, *event.evicted]
    largest = max([*ids, *map(int, event.admitted), *map(int, event.scores)], default=0)
    if largest > bound:
        raise ValueError(f"event {i} names window {largest}; this lane's windows are 0..{bound} (the session's "
                         f"{total} tokens at its Ω)")


def parse_document(raw: bytes | str | dict) -> SessionDocument:
    """A validated export (one of an older format upgraded first), or ValueError with what is wrong (the first few
    problems, by location)."""
    try:
        if not isinstance(raw, dict):
            try:
                raw = json.loads(raw)
            except ValueError as err:
                raise ValueError(f"document: not JSON ({err})") from None
        return SessionDocument.model_validate(upgrade_document(raw))
    except ValidationError as err:
        raise ValueError(describe(err)) from None


def parse_stored(prompt: Any, request: Any, events: list[Any]) -> tuple[RequestSpec, list]:
    """A stored session checked against the same models (a row written by an older version, or by hand, may not
    fit): -> (request, events), or ValueError."""
    doc = {"format": EXPORT_FORMAT, "session": {"prompt": prompt, "request": request}, "events": events}
    parsed = parse_document(doc)
    return parsed.session.request, parsed.events


def message(item: dict) -> str:
    """A pydantic error's words without its kind ("Value error, ...")."""
    return item["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")


def describe(err: ValidationError, limit: int = 3) -> str:
    problems = []
    for item in err.errors()[:limit]:
        where = ".".join(str(part) for part in item["loc"]) or "document"
        problems.append(f"{where}: {message(item)}")
    more = err.error_count() - limit
    return "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")
