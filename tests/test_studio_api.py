"""The generation event is callable as ``/generate`` with gradio_client; concurrent callers are queued and each
gets its own session."""

import dataclasses
import socket


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
        share1, share2 = out1[-1], out2[-1]
        assert "/?session=" in share1 and share1 != share2
        # A refused call is a well-formed result: the reason in the status, an empty table, no share link.
        bad = client.predict(prompt="", **args, api_name="/generate")
        assert bad[0] == "**Cannot run:** Prompt: it is empty: write one or pick an example."
        assert bad[2]["data"] == [] and bad[-1] == ""
        wrong_layer = client.predict(prompt="hi", **{**args, "layer": 7}, api_name="/generate")
        assert "layer: must be a whole number from 0 to 2 (got 7" in wrong_layer[0]
        # Off the controls' choices or of the wrong JSON type: the same nine outputs, the reason in status, and
        # nothing converted (Gradio's components would raise, or turn "16" into 16).
        for change, reason in [({"lane1": "magic"}, "unknown method(s) ['magic']; allowed:"),
                               ({"lane1": {"method": "qevict"}}, "Lanes: Input should be a valid string"),
                               ({"bits": 3}, "bits: must be one of (2, 4) (got 3)"),
                               ({"bits": "2"}, "bits: Input should be a valid integer (got '2')"),
                               ({"scorer": "nope"}, "scorer: must be one of"),
                               ({"max_new_tokens": "16"}, "Max new tokens: Input should be a valid integer"),
                               ({"promotion": "yes"}, "promotion: Input should be a valid boolean"),
                               ({"prompt": 12345}, "Prompt: Input should be a valid string"),
                               ({"prompt": ["hi"]}, "Prompt: Input should be a valid string")]:
            out = client.predict(**{"prompt": "hi", **args, **change}, api_name="/generate")
            assert len(out) == 9 and out[0].startswith("**Cannot run:**") and reason in out[0], (change, out[0])
            assert out[2]["data"] == [] and out[-1] == ""
    finally:
        demo.close()
    from sqlalchemy import select

    from storage import make_engine
    from storage.db import SessionRow

    with make_engine(db).connect() as conn:
        rows = conn.execute(select(SessionRow.prompt, SessionRow.status)).all()
    assert sorted(prompt[:5] for prompt, _ in rows) == ["bonjo", "hello"]
    assert all(status == "done" for _, status in rows)


def test_the_published_schema_is_the_validators():
    """What /generate advertises is what ui.form accepts: bits as integers 2 or 4, every runnable lane (ablations
    included), the pickers' ranges, nothing empty; and every advertised bits value runs."""
    import app
    from qevict_core.registry import METHODS
    from ui.form import NO_LANE, Controls, parse_request

    demo = app.create_demo(tiny_chat_model(), tiny_tokenizer(), database_url="sqlite://", model_name="tiny")
    params = {p["parameter_name"]: p["type"] for p in demo.get_api_info()["named_endpoints"]["/generate"]["parameters"]}
    assert params["bits"] == {"type": "integer", "enum": [2, 4]}
    assert params["lane1"]["enum"] == [NO_LANE, *METHODS] and "qevict_nopromo" in params["lane2"]["enum"]
    assert params["budget"]["minimum"] == 0.01 and params["omega"] == {"type": "integer", "minimum": 1, "maximum": 64}
    assert params["layer"]["maximum"] == 2 and params["shown_lane"]["anyOf"][0] == {"type": "string"}
    assert params["present"] == {"type": "boolean"}
    for bits in params["bits"]["enum"]:
        parse_request(Controls.lanes(["qevict"], prompt="hi", bits=bits, max_new_tokens=4))


def test_the_form_s_config_fields_come_from_the_config_s_declaration(monkeypatch):
    """Each config control's range, choices and type are QEvictConfig's declaration (config.Knob), narrowed only
    where the studio caps it (ui.form.CAPS); whether a scorer may be pooled is its file's, never a name in the form."""
    from qevict_core import QEvictConfig
    from qevict_core.config import SCORER_FILES
    from ui import form

    knobs = QEvictConfig.knobs()
    for name in ("budget", "omega", "q_frac", "sinks", "recent", "coverage"):
        low, high = form.CAPS.get(name, (None, None))
        schema = form.api_schema(name)
        assert schema.get("minimum", schema.get("exclusiveMinimum")) == (knobs[name].low if low is None else low)
        assert schema.get("maximum") == (knobs[name].high if high is None else high), name
    assert form.api_schema("scorer")["enum"] == list(knobs["scorer"].choices)
    assert form.api_schema("bits")["enum"] == list(knobs["bits"].choices)
    pooled = form.parse_request(form.Controls.lanes(["qevict"], prompt="hi", scorer="decay"))
    assert pooled.config.pool == QEvictConfig().pool
    monkeypatch.setitem(SCORER_FILES, "decay", dataclasses.replace(SCORER_FILES["decay"], needs_attention=False))
    assert form.parse_request(form.Controls.lanes(["qevict"], prompt="hi", scorer="decay")).config.pool == 0
