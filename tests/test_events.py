"""Events round-trip through their dict form (what storage keeps and replays)."""

import json

import pytest

from qevict_core import Lane, QEvictConfig, Sampling, event_from_dict, generate_lanes, make_cache
from tests.conftest import random_prompt, tiny_model
from tests.test_equivalence import _Tok


def test_every_streamed_event_survives_json():
    model = tiny_model()
    lanes = [Lane(m, make_cache(m, model, QEvictConfig(budget=0.3, record_events=True), max_length=420)) for m in ("qevict", "snapkv")]
    events = list(generate_lanes(model, _Tok(), random_prompt(400), lanes, Sampling(max_new_tokens=20)))
    assert {e.kind for e in events} == {"token", "memory", "routing", "done"}
    for event in events:
        stored = json.loads(json.dumps(event.to_dict()))
        restored = event_from_dict(stored)
        assert type(restored) is type(event) and restored.to_dict() == stored
        if event.kind != "routing":  # routing scores are stored rounded to 6 decimals
            assert restored == event


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="unknown event kind 'x'; allowed:"):
        event_from_dict({"kind": "x"})
