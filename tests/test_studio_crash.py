"""A studio process killed with SIGKILL mid-run and started again: the run it was streaming is marked
"interrupted" and keeps every step it showed but the last, per lane."""

import re
import time

import pytest

from tests.browser import StudioProcess, chromium, need_chromium, open_page, reload, set_number

pytestmark = pytest.mark.browser


def shown_tokens(page, root: str = "#lanes") -> dict[str, int]:
    """Tokens each lane card shows right now, read in one snapshot inside the page (the cards re-render at every
    step, so element handles taken one by one may be detached under load)."""
    cards = page.evaluate("root => [...document.querySelectorAll(root + ' .qe-lane')].map("
                          "c => [c.dataset.lane, c.querySelector('.qe-stats')?.innerText || ''])", root)
    out = {}
    for lane, stats in cards:
        match = re.match(r"(\d+) tokens", stats)
        out[lane] = int(match.group(1)) if match else 0
    return out


def test_a_crash_leaves_the_run_interrupted_with_what_was_shown(tmp_path):
    need_chromium()
    from storage import SessionStore, make_engine

    url = f"sqlite:///{tmp_path}/crash.sqlite"
    server = StudioProcess(url, seconds_per_forward=0.05)  # 512 steps take at least 25 s
    try:
        base = server.start()
        with chromium() as (browser, outside):
            page = open_page(browser, base)
            page.fill("#prompt textarea", "Remember the lantern. " * 40)
            set_number(page, "max-new", 512)
            page.click("#generate")
            page.wait_for_function("document.querySelector('#share a') !== null", timeout=60_000)
            session_id = page.locator("#share a").first.get_attribute("href").split("session=")[1]
            page.wait_for_function("[...document.querySelectorAll('#lanes .qe-stats')].length === 3 && "
                                   "[...document.querySelectorAll('#lanes .qe-stats')].every("
                                   "e => parseInt(e.innerText) >= 12)", timeout=120_000)
            seen = shown_tokens(page)
            server.kill()
            store = SessionStore(make_engine(url))
            assert store.get(session_id)["status"] == "running"  # nobody could say otherwise while it was down

            base = server.start(same_port=True)  # same database, new process, where the tab left it
            assert store.get(session_id)["status"] == "interrupted"
            reload(page)  # the open tab comes back: its prompt, and a line saying what happened
            page.wait_for_function("document.querySelector('#status')?.innerText.includes('server restarted')",
                                   timeout=60_000)
            assert page.locator("#prompt textarea").input_value() == "Remember the lantern. " * 40
            assert session_id in page.locator("#status").inner_text()
            assert outside == []
        events = store.events(session_id)
        stored = {lane: sum(e["kind"] == "token" and e["lane"] == lane for e in events) for lane in seen}
        for lane, count in seen.items():
            assert stored[lane] >= count - 1, f"{lane}: {count} tokens shown, {stored[lane]} kept"
            assert stored[lane] < 512
        with chromium() as (browser, outside):
            replay = open_page(browser, f"{base}/?session={session_id}")
            replay.wait_for_function("document.querySelector('#replay-status')?.innerText.includes('interrupted')",
                                     timeout=60_000)
            last = max(e["step"] for e in events)
            assert f"step {last} of {last}" in replay.locator("#replay-status").inner_text()
            deadline = time.time() + 60  # the cards render after the status line: wait for them, not a fixed time
            while shown_tokens(replay, "#replay-lanes") != stored and time.time() < deadline:
                time.sleep(0.2)
            assert shown_tokens(replay, "#replay-lanes") == stored
            assert outside == []
    finally:
        server.kill()
