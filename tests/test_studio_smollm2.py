"""The studio on the bundled SmolLM2 (slow: loads the model): the README's gradio_client snippet runs as printed,
and every example builds every default lane, the short ones at the least budget they can run with."""

import re
from pathlib import Path

import pytest

from tests.browser import free_port
from ui.examples import EXAMPLES
from ui.form import parse_request

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def smollm2_studio(smollm2, tmp_path_factory):
    import app

    port = free_port()
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'studio.sqlite'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_SERVER_PORT", str(port))
        demo = app.create_demo(*smollm2, database_url=db)
        app.launch(demo, prevent_thread_lock=True)
        yield f"http://127.0.0.1:{port}/", demo
        demo.close()


def test_the_readme_gradio_client_snippet_runs_as_printed(smollm2_studio, capsys):
    url, _ = smollm2_studio
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "gradio_client" in b)
    assert 'Client("http://127.0.0.1:7860/")' in block
    scope: dict = {}
    exec(compile(block.replace("http://127.0.0.1:7860/", url), "README.md", "exec"), scope)
    printed = capsys.readouterr().out.strip().splitlines()[-1]  # gradio_client first says "Loaded as API"
    assert printed.startswith("**Done.**"), printed[:300]
    assert scope["stats"]["headers"] == ["measure", "fullkv", "snapkv", "qevict"]
    rows = {row[0]: row[1:] for row in scope["stats"]["data"]}
    assert rows["tokens"][0] > 0 and all(t > 0 for t in rows["tokens"])
    assert "/?session=" in scope["share"]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_builds_every_default_lane(smollm2, name):
    from storage import SessionStore, make_engine
    from ui.studio import Studio

    studio = Studio(*smollm2, SessionStore(make_engine("sqlite://")))
    prompt, expected = EXAMPLES[name]()
    req = parse_request(prompt, ["fullkv", "snapkv", "qevict"], 0.2, 8, 0.7, 2, 5, 32, "cumulative", True, 64,
                        0.0, 0, expected)
    input_ids, lanes, request = studio.prepare(req)
    fullkv = lanes[0].cache.shape.fullkv_bytes(input_ids.shape[1] + 64)
    for lane, spec in zip(lanes, request["lanes"]):
        if "budget_bytes" in spec:  # raised: the note says to what and why, and the cache holds to it
            assert input_ids.shape[1] < 400, f"{name}: a long prompt should run at the asked budget"
            assert lane.cache.budget_bytes == spec["budget_bytes"] > 0.2 * fullkv
            assert f"Runs at {spec['budget_bytes'] / fullkv:.1%}" in spec["note"]
        elif lane.cache.budget_bytes is not None:
            assert lane.cache.budget_bytes == int(0.2 * fullkv)
    if name.startswith("Needle"):
        assert not any("budget_bytes" in spec for spec in request["lanes"])
