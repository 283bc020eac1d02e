"""The studio across ZeroGPU's process boundary (tests/zerogpu.py: a forked worker, everything pickled): tokens,
routing views, Stop, "time the lanes alone" and the diagnostics all work, and only the studio's process touches
the database."""

from __future__ import annotations

import os

import pytest

from qevict_core import QEvictConfig, Sampling
from storage import SessionStore, make_engine
from tests.conftest import tiny_chat_model, tiny_tokenizer
from tests.zerogpu import ForkedGPU
from ui.form import RunRequest

PROMPT = "The lighthouse keeper counted the ships. " * 30


@pytest.fixture
def forked(monkeypatch, tmp_path):
    import ui.gpu
    from ui.studio import Studio

    gpu = ForkedGPU()
    monkeypatch.setattr(ui.gpu, "GPU", gpu)
    store = SessionStore(make_engine(f"sqlite:///{tmp_path}/zero.sqlite"))
    pids = []
    for name in ("create", "append", "finish", "get", "events"):
        method = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _m=method, **k: (pids.append(os.getpid()), _m(*a, **k))[1])
    studio = Studio(tiny_chat_model(), tiny_tokenizer(), store, "tiny")
    return studio, gpu, pids


def request(max_new: int) -> RunRequest:
    return RunRequest(PROMPT, ("fullkv", "qevict"), QEvictConfig(budget=0.3, record_events=True),
                      Sampling(max_new_tokens=max_new))


def test_a_run_streams_and_stops_across_the_boundary(forked):
    studio, gpu, pids = forked
    seen, stopped = [], False

    def stop():
        return stopped

    for update in studio.run(request(200), stop):
        seen.append(max(len(lane.tokens) for lane in update.view.lanes.values()))
        stopped = stopped or seen[-1] >= 20
    final = update
    assert gpu.calls and gpu.calls[0]["pid"] != os.getpid() and not gpu.last.is_alive()
    assert gpu.calls[0]["seconds"] <= 120
    assert seen[:5] == sorted(seen[:5]) and len(set(seen)) > 10  # token by token
    assert final.status == "stopped" and 20 <= seen[-1] < 200
    assert {lane.done for lane in final.view.lanes.values()} == {"stopped"}
    assert final.view.routed_lanes() == ["qevict"] and final.view.lanes["qevict"].summary["k_quant"] > 0
    stored = studio.store.get(final.session_id)
    assert stored["status"] == "stopped"
    assert len([e for e in studio.store.events(final.session_id) if e["kind"] == "token"]) == 2 * seen[-1]
    assert set(pids) == {os.getpid()}  # the worker never touched the database


def test_a_closed_tab_ends_the_worker(forked):
    studio, gpu, _ = forked
    stream = studio.run(request(400))
    for _ in range(4):
        update = next(stream)
    stream.close()  # Gradio closes the generator when the tab goes away
    assert not gpu.last.is_alive()
    assert studio.store.get(update.session_id)["status"] == "stopped"


def test_timing_and_diagnostics_cross_the_boundary(forked):
    from ui.studio import diagnose_run

    studio, gpu, pids = forked
    final = list(studio.run(request(24)))[-1]
    timing = studio.time_lanes(final.session_id, new_tokens=5)
    assert set(timing.lanes) == {"fullkv", "qevict"} and timing.lanes["fullkv"]["ratio"] == 1.0
    diagnosis = diagnose_run(studio, final.session_id)
    assert set(diagnosis.lanes) == {"qevict"} and not diagnosis.problems
    assert len(gpu.calls) == 3 and all(call["pid"] != os.getpid() for call in gpu.calls)
    assert set(pids) == {os.getpid()}
