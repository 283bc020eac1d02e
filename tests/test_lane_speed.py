"""Lanes share one forward, yet each reports its own speed: its cache and attention work is timed inside the
shared forward, so a slow method shows as slow next to a fast one."""

import time
from statistics import median

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.generation.generate import lane_seconds
from tests.conftest import random_prompt, tiny_model
from tests.test_equivalence import _Tok


def test_the_shared_part_is_split_off_each_lanes_own_time():
    assert lane_seconds(1.0, [0.2, 0.5], timed=True) == [0.5, 0.8]  # shared 0.3 + own
    assert lane_seconds(1.0, [0.0], timed=True) == [1.0]  # one lane: its forward is its own
    assert lane_seconds(1.0, [0.2, 0.5], timed=False) == [None, None]


def test_a_lane_that_does_more_work_reports_a_longer_time(monkeypatch):
    model = tiny_model("llama", 2)
    lanes = [Lane(m, make_cache(m, model, QEvictConfig(budget=0.3), max_length=300 + 16)) for m in ("fullkv", "h2o")]
    slow = lanes[1].cache.layers[0].attend

    def slower(*args, **kwargs):  # stands in for a method whose attention costs 20 ms more per layer
        time.sleep(0.02)
        return slow(*args, **kwargs)

    monkeypatch.setattr(lanes[1].cache.layers[0], "attend", slower)
    events = list(generate_lanes(model, _Tok(), random_prompt(300), lanes, Sampling(max_new_tokens=16)))
    alone = {name: [e.alone_seconds for e in events if e.kind == "token" and e.lane == name and e.step > 0]
             for name in ("fullkv", "h2o")}
    shared = [e.seconds for e in events if e.kind == "token" and e.lane == "fullkv" and e.step > 0]
    # Medians over the 15 decode steps: a busy machine can stall any single step of either lane.
    fast, slow_, forward = (median(v) for v in (alone["fullkv"], alone["h2o"], shared))
    assert slow_ - fast > 0.015  # the sleep shows in the slow lane only
    assert fast < forward and slow_ <= forward
    assert all(s <= f for s, f in zip(alone["h2o"], shared))  # a lane's own time never exceeds the forward
