"""The generation event is callable as ``/generate`` with gradio_client; concurrent callers are queued and each
gets its own session."""

import socket

import pytest

from tests.conftest import tiny_chat_model, tiny_tokenizer


def test_two_clients_are_queued_and_isolated(tmp_path, monkeypatch):
    import app
    from gradio_client import Client

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(port))
    db = f"sqlite:///{tmp_path}/api.sqlite"
    demo = app.create_demo(tiny_chat_model(), tiny_tokenizer(), database_url=db, model_name="tiny")
    app.launch(demo, prevent_thread_lock=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        args = dict(lane1="fullkv", lane2="(none)", lane3="qevict", budget=0.3, omega=8, q_frac=0.7, bits=2, sinks=5,
                    recent=32, scorer="cumulative", promotion=True, max_new_tokens=12, temperature=0, seed=0, layer=1)
        first = client.submit(prompt="hello there " * 40, **args, api_name="/generate")
        second = client.submit(prompt="bonjour tout le monde " * 25, **args, api_name="/generate")
        out1, out2 = first.result(timeout=300), second.result(timeout=300)
        assert out1[0] == out2[0] == "**Done.**"
        assert len(list(first)) > 2  # it streamed
        share1, share2 = out1[6], out2[6]
        assert share1 != share2
        bad = client.predict(prompt="", **args, api_name="/generate")
        assert "prompt is empty" in bad[0]
    finally:
        demo.close()
    from storage import SessionStore, make_engine

    sessions = SessionStore(make_engine(db)).list()
    assert sorted(s["prompt"][:5] for s in sessions) == ["bonjo", "hello"]
    assert all(s["status"] == "done" for s in sessions)
