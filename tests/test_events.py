"""Events are declared once (qevict_core/events.py): they round-trip through their JSON form, storage's bounded
models are derived from their fields, and a routing event carries the grid its windows lie on."""

import dataclasses
import json

import pytest

from qevict_core import Lane, QEvictConfig, Sampling, event_from_dict, generate_lanes, make_cache
from qevict_core.events import EVENT_TYPES, RoutingEvent
from storage import schema
from tests.conftest import random_prompt, tiny_model
from tests.test_equivalence import _Tok


def test_every_streamed_event_survives_json_and_fits_the_stored_schema():
    model = tiny_model()
    config = QEvictConfig(budget=0.3, record_events=True)
    lanes = [Lane(m, make_cache(m, model, config, max_length=420)) for m in ("qevict", "snapkv")]
    events = list(generate_lanes(model, _Tok(), random_prompt(400), lanes, Sampling(max_new_tokens=20)))
    assert {e.kind for e in events} == set(EVENT_TYPES)
    for event in events:
        stored = json.loads(json.dumps(event.to_dict()))
        schema.EVENT_MODELS[event.kind].model_validate(stored)  # what storage would keep
        restored = event_from_dict(stored)
        assert type(restored) is type(event) and restored.to_dict() == stored
        if event.kind != "routing":  # routing scores are stored rounded to 6 decimals
            assert restored == event
    routing = next(e for e in events if e.kind == "routing")
    assert (routing.sinks, routing.omega) == (config.sinks, config.omega)
    assert routing.grid.start(1) == config.sinks + config.omega


def test_the_stored_models_have_exactly_the_event_fields():
    for kind, cls in EVENT_TYPES.items():
        assert set(schema.EVENT_MODELS[kind].model_fields) == {f.name for f in dataclasses.fields(cls)}


def test_a_field_without_a_bound_stops_storage_from_loading():
    @dataclasses.dataclass
    class Grown(RoutingEvent):
        colour: str = "red"

    with pytest.raises(TypeError, match="Grown.colour has no bound in storage.schema.BOUNDS"):
        schema._stored_model("routing", Grown)


def test_tiers_after_an_event():
    event = RoutingEvent(lane="q", step=0, layer=0, seen=30, recent_start=22, sinks=2, omega=4, full=[0, 2],
                         quantized=[1], promoted=[], demoted=[], evicted=[3])
    # windows 0-4 cover positions 2-21; window 5 starts at 22 (recent), window 7 at 30 (not yet)
    assert event.tiers(range(8)) == ["full", "quantized", "full", "evicted", "evicted", "recent", "recent", None]


@pytest.mark.parametrize("data, words", [
    ({"kind": "x"}, "unknown event kind 'x'; allowed:"),
    ({"kind": "token", "lane": "a", "step": 0, "token_id": 1, "text": "a", "colour": 1}, r"no field\(s\) \['colour'\]"),
    ({"kind": "token", "lane": "a", "step": 0}, r"needs the field\(s\) \['token_id', 'text'\]"),
])
def test_a_malformed_event_is_refused_with_its_reason(data, words):
    with pytest.raises(ValueError, match=words):
        event_from_dict(data)
