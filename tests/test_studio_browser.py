"""The studio in Debian's chromium through Playwright: a two-lane run streams, the tier map and heatmap render,
the share link replays it step by step, and no request leaves 127.0.0.1."""

import shutil
import socket
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
OUTPUT = Path(__file__).resolve().parents[1] / "test-output"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def studio_url(tmp_path_factory, monkeypatch_module):
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    import app
    from tests.conftest import tiny_chat_model, tiny_tokenizer

    port = free_port()
    monkeypatch_module.setenv("GRADIO_SERVER_PORT", str(port))
    db = tmp_path_factory.mktemp("db") / "studio.sqlite"
    demo = app.create_demo(tiny_chat_model(), tiny_tokenizer(), database_url=f"sqlite:///{db}", model_name="tiny")
    app.launch(demo, prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}"
    demo.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_run_stream_share_and_replay(studio_url):
    from playwright.sync_api import expect, sync_playwright

    OUTPUT.mkdir(exist_ok=True)
    outside = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})

        def record(req):
            if not req.url.startswith(("http://127.0.0.1", "data:", "blob:")):
                outside.append(req.url)

        page.on("request", record)
        page.goto(studio_url)
        page.fill("#prompt textarea", "The quick brown fox jumps over the lazy dog. " * 30 + "What jumps?")
        page.locator("#lane2 input").fill("(none)")
        page.keyboard.press("Enter")
        page.locator("#max-new input[type=number]").fill("40")
        page.keyboard.press("Enter")
        page.click("#generate")
        # Streaming: some text shows up before the run is done.
        expect(page.locator("#lanes .qe-lane")).to_have_count(2, timeout=30_000)
        page.wait_for_function("document.querySelector('#lanes .qe-stats')?.textContent.includes('tokens')")
        expect(page.locator("#status")).to_contain_text("Done.", timeout=120_000)
        lanes = page.locator("#lanes .qe-lane")
        assert lanes.nth(0).get_attribute("data-lane") == "fullkv"
        assert lanes.nth(1).get_attribute("data-lane") == "qevict"
        for i in range(2):
            expect(lanes.nth(i).locator(".qe-stats")).to_contain_text("40 tokens")
        expect(page.locator("#tier-map .js-plotly-plot")).to_have_count(1)
        expect(page.locator("#heatmap .js-plotly-plot")).to_have_count(1)
        expect(page.locator("#tier-map")).to_contain_text("qevict: layer")
        expect(page.locator("#prompt-tiers")).to_contain_text("quantized")
        page.screenshot(path=str(OUTPUT / "studio-run.png"), full_page=True)

        link = page.locator("#share a").first.get_attribute("href")
        assert "/?session=" in link and link.startswith(studio_url)
        replay = browser.new_page(viewport={"width": 1400, "height": 1400})
        replay.on("request", record)
        replay.goto(link)
        expect(replay.locator("#replay-status")).to_contain_text("step 39 of 39", timeout=30_000)
        final_text = replay.locator("#replay-lanes .qe-lane").nth(1).locator(".qe-text").inner_text()
        step_box = replay.locator("#replay-step input[type=number]")
        step_box.fill("3")
        step_box.press("Enter")
        expect(replay.locator("#replay-status")).to_contain_text("step 3 of 39", timeout=30_000)
        expect(replay.locator("#replay-lanes .qe-stats").nth(0)).to_contain_text("4 tokens")
        replay.click("#replay-play")
        expect(replay.locator("#replay-status")).to_contain_text("step 39 of 39", timeout=60_000)
        time.sleep(0.5)
        assert replay.locator("#replay-lanes .qe-lane").nth(1).locator(".qe-text").inner_text() == final_text
        expect(replay.locator("#replay-tier-map .js-plotly-plot")).to_have_count(1)
        replay.screenshot(path=str(OUTPUT / "studio-replay.png"), full_page=True)

        missing = browser.new_page()
        missing.goto(f"{studio_url}/?session=not-a-real-session")
        expect(missing.locator("#replay-status")).to_contain_text("No such session", timeout=30_000)
        browser.close()
    assert outside == [], f"requests left 127.0.0.1: {outside[:5]}"
