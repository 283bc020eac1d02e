"""The studio in Debian's chromium through Playwright, on the tiny random chat model: every example runs at the
default settings, a run streams and replays by its share link, a poisoned import is refused while everything
else keeps working, a second browser sees none of the first's sessions, Stop keeps a queued run from starting and
a closed tab stops its run. No request leaves 127.0.0.1."""

import json
import re
import time

import pytest

from tests.browser import PHONE, chromium, free_port, need_chromium, open_page, pick, pick_example, set_number, shot
from ui.examples import EXAMPLES

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    need_chromium()
    import app
    from tests.conftest import tiny_chat_model, tiny_tokenizer

    port = free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_SERVER_PORT", str(port))
        db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'studio.sqlite'}"
        demo = app.create_demo(tiny_chat_model(), tiny_tokenizer(), database_url=db, model_name="tiny")
        app.launch(demo, prevent_thread_lock=True)
        yield {"url": f"http://127.0.0.1:{port}", "database_url": db}
        demo.close()


@pytest.fixture
def browser(studio):
    with chromium() as (browser, outside):
        yield browser
    assert outside == [], f"requests left 127.0.0.1: {outside[:5]}"


def wait_text(page, selector: str, text: str, timeout: int = 30_000) -> None:
    page.wait_for_function(f"document.querySelector({selector!r})?.innerText.includes({text!r})", timeout=timeout)


def share_link(page) -> str:
    page.wait_for_function("document.querySelector('#share a') !== null", timeout=60_000)
    return page.locator("#share a").first.get_attribute("href")


def wait_done(page, timeout=120_000):
    page.wait_for_function("['Done.', 'Stopped', 'Error', 'Cannot run'].some(w => "
                           "document.querySelector('#status').innerText.includes(w))", timeout=timeout)
    return page.locator("#status").inner_text()


def sessions_listed(page, until=lambda ids: bool(ids)) -> list[str]:
    """Session ids (22 url-safe characters) in the Sessions tab's table, top to bottom: read until ``until`` holds
    (the list is filled after the tab shows, and again when the browser's list of owned sessions changes, which
    comes after the run on a loaded machine), or 120 s passed; then the last read."""
    page.click("button[role=tab]:has-text('Sessions')")
    page.locator("#sessions-table").wait_for(state="visible")
    deadline = time.time() + 120
    while True:
        ids = re.findall(r"(?<![\w-])[\w-]{22}(?![\w-])", page.locator("#sessions-table").inner_text())
        if until(ids) or time.time() > deadline:
            return ids
        time.sleep(0.2)


def assert_no_sessions_listed(page) -> None:
    """The Sessions tab has loaded this browser's list (its label says how many) and it is empty."""
    page.click("button[role=tab]:has-text('Sessions')")
    wait_text(page, "#sessions-table", "No runs saved in this browser yet", 120_000)
    assert sessions_listed(page, lambda ids: True) == []


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_runs_at_the_default_settings(studio, browser, name):
    page = open_page(browser, studio["url"])
    pick_example(page, name)
    page.click("#generate")
    status = wait_done(page)
    assert "Done." in status, status
    cards = page.locator("#lanes .qe-lane")
    assert cards.count() == 3
    for i in range(3):
        assert " tokens" in cards.nth(i).locator(".qe-stats").inner_text()
    expected = EXAMPLES[name]().expected
    assert page.locator("#example-hint").inner_text().strip()  # what to look at, in one line
    if expected:
        assert page.locator("#expected input, #expected textarea").first.input_value() == expected
        assert "the answer “" in cards.nth(2).locator(".qe-answer").inner_text()
    if name.startswith("Needle"):
        shot(page, "studio-needle-1280")
        page.set_viewport_size(PHONE)
        page.wait_for_function(f"document.documentElement.clientWidth <= {PHONE['width']}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"] + 1, f"the page scrolls sideways on a phone ({width} px)"
        table = page.locator("#stats")
        assert table.locator("thead th").count() == 4  # measure + 3 lanes fit a phone
        # every column of the stats table is inside its box or the box scrolls: nothing is clipped unreachable
        assert page.evaluate("""() => { const box = document.querySelector('#stats');
            const last = [...box.querySelectorAll('thead th')].pop().getBoundingClientRect();
            const scroller = [box, ...box.querySelectorAll('*')].find(e => e.scrollWidth > e.clientWidth + 1 &&
                ['auto', 'scroll'].includes(getComputedStyle(e).overflowX));
            return last.right <= box.getBoundingClientRect().right + 1 || scroller !== undefined; }""")
        page.get_by_text("What each method keeps").click()
        page.locator("#methods td").first.wait_for(state="visible")
        narrowest = page.evaluate("Math.min(...[...document.querySelectorAll('#methods td')].map("
                                  "c => c.getBoundingClientRect().width))")
        assert narrowest >= 60, f"a method-table column is {narrowest:.0f} px wide: words break every few letters"
        # the bytes plot's legend, wrapped into rows on a phone, clears its axes' tick labels and titles
        assert page.evaluate("""() => { const plot = document.querySelector('#bytes');
            const box = plot.querySelector('.legend').getBoundingClientRect();
            return [...plot.querySelectorAll('.xtick text, .g-xtitle text, .g-x2title text, .g-x3title text')]
                .map(t => t.getBoundingClientRect()).every(r => r.bottom <= box.top || r.top >= box.bottom ||
                                                                r.right <= box.left || r.left >= box.right); }""")
        shot(page, "studio-needle-390")
        assert sessions_listed(page)  # this run, listed: the table stays inside the phone's width
        right = page.evaluate("document.querySelector('#sessions-table').getBoundingClientRect().right")
        assert right <= PHONE["width"] + 1, f"the Sessions table reaches {right:.0f} px on a {PHONE['width']} px phone"


def test_run_stream_share_and_replay(studio, browser):
    page = open_page(browser, studio["url"], {"width": 1400, "height": 1600})
    page.fill("#prompt textarea", "The quick brown fox jumps over the lazy dog. " * 30 + "What jumps?")
    page.locator("#ablations input").check()  # per-head routing is an ablation: in the menus only when asked
    pick(page, "lane2", "ablation · qevict_head")
    set_number(page, "max-new", 40)
    page.click("#generate")
    page.wait_for_function("document.querySelector('#lanes .qe-stats')?.textContent.includes('tokens')",
                           timeout=30_000)  # streaming: text before the run is done
    assert "Done." in wait_done(page)
    lanes = page.locator("#lanes .qe-lane")
    assert [lanes.nth(i).get_attribute("data-lane") for i in range(3)] == ["fullkv", "qevict_head", "qevict"]
    for i in range(3):
        assert "40 tokens" in lanes.nth(i).locator(".qe-stats").inner_text()
    assert page.locator("#tier-map .js-plotly-plot").count() == 1
    assert page.locator("#heatmap .js-plotly-plot").count() == 1
    assert page.locator("#bytes .js-plotly-plot").count() == 1
    # the heatmap's title sits inside its box, clear of the colour bar
    title, plot = page.locator("#heatmap .gtitle").bounding_box(), page.locator("#heatmap .js-plotly-plot").bounding_box()
    bar = page.locator("#heatmap .colorbar").bounding_box()
    assert plot["y"] <= title["y"] and title["y"] + title["height"] < bar["y"], (title, plot, bar)
    assert "cumulative attention per window" in page.locator("#heatmap .gtitle").text_content()
    assert "qevict_head: layer 1, KV head 0" in page.locator("#tier-map").inner_text()  # routed per head
    set_number(page, "head", 1)
    wait_text(page, "#tier-map", "qevict_head: layer 1, KV head 1", 30_000)
    assert "KV head 1" in page.locator("#prompt-tiers").inner_text()
    assert "low-bit" in page.locator("#prompt-tiers").inner_text()
    assert "Latest moves:" in page.locator("#moves").inner_text()
    pick(page, "shown-lane", "qevict")  # the lane picker: QEvict's own routing, routed per layer
    wait_text(page, "#tier-map", "qevict: layer 1,", 30_000)
    assert "qevict_head" not in page.locator("#tier-map").inner_text()
    shot(page, "studio-run")

    link = share_link(page)
    assert "/?session=" in link and link.startswith(studio["url"])
    replay = open_page(browser, link, {"width": 1400, "height": 1400}, context=browser.new_context())
    wait_text(replay, '#replay-status', 'step 39 of 39', 30_000)
    final_text = replay.locator("#replay-lanes .qe-lane").nth(1).locator(".qe-text").inner_text()
    set_number(replay, "replay-step", 3)
    wait_text(replay, '#replay-status', 'step 3 of 39', 30_000)
    assert "4 tokens" in replay.locator("#replay-lanes .qe-stats").nth(0).inner_text()
    replay.click("#replay-play")
    wait_text(replay, '#replay-status', 'step 39 of 39', 60_000)
    replay.wait_for_function("t => document.querySelectorAll('#replay-lanes .qe-lane .qe-text')[1]?.innerText === t",
                             arg=final_text, timeout=30_000)
    shot(replay, "studio-replay")
    missing = open_page(browser, f"{studio['url']}/?session=not-a-real-session")
    wait_text(missing, '#replay-status', 'No such session', 30_000)


def test_a_share_link_opens_in_presentation_mode_for_a_projector(studio, browser):
    page = open_page(browser, studio["url"])
    page.fill("#prompt textarea", "The quick brown fox jumps over the lazy dog. " * 30 + "What jumps?")
    set_number(page, "max-new", 24)
    page.click("#generate")
    assert "Done." in wait_done(page)
    projector = {"width": 1920, "height": 1080}
    show = open_page(browser, share_link(page) + "&present=1", projector, context=browser.new_context())
    wait_text(show, "#replay-status", "step 23 of 23", 60_000)
    show.wait_for_function("document.body.classList.contains('qe-present')", timeout=60_000)
    assert show.locator("#present input").is_checked()
    size = "s => parseFloat(getComputedStyle(document.querySelector(s)).fontSize)"
    assert show.evaluate(size, "#replay-lanes .qe-text") >= 22 and show.evaluate(size, "#replay-status") >= 20
    small = {s: show.evaluate(size, s) for s in ("#replay-lanes .qe-stats", "#replay-moves li",
                                                  "#replay-prompt-tiers .qe-prompt-text")}
    assert min(small.values()) >= 18, small
    for aside in ("#intro", "#replay-stats", "#replay-bytes"):  # the routing in focus: the rest steps aside
        assert not show.locator(aside).is_visible(), aside
    # the figures are redrawn large (plots.LARGE) and each takes the whole width, the scores under the tier map
    show.wait_for_function(f"document.querySelector('#replay-tier-map .gtitle') && "
                           f"{size.replace('s =>', '(s =>')})('#replay-tier-map .gtitle') >= 20", timeout=60_000)
    tier, heat = (show.locator(f"#replay-{name} .js-plotly-plot").bounding_box() for name in ("tier-map", "heatmap"))
    assert tier["width"] >= 0.8 * projector["width"] and heat["y"] >= tier["y"] + tier["height"] - 1, (tier, heat)
    shot(show, "studio-present-1920")
    show.locator("#present input").uncheck()  # and back: the page's own sizes
    show.wait_for_function("!document.body.classList.contains('qe-present')", timeout=60_000)
    show.wait_for_function(f"{size.replace('s =>', '(s =>')})('#replay-tier-map .gtitle') < 16", timeout=60_000)
    assert show.locator("#replay-stats").is_visible()


POISON = {"format": "qevict-session/1", "session": {"prompt": "x", "request": {
    "lanes": [{"name": 5, "method": "fullkv"}], "config": {"sinks": 5, "omega": 8}}}, "events": []}


def test_a_poisoned_import_is_refused_and_breaks_nothing(studio, browser, tmp_path):
    first = browser.new_context()
    page = open_page(browser, studio["url"], context=first)
    page.fill("#prompt textarea", "Tell me about lanterns. " * 20)
    set_number(page, "max-new", 8)
    page.click("#generate")
    link = share_link(page)
    assert "Done." in wait_done(page)
    good_id = link.split("session=")[1]

    poison = tmp_path / "poison.json"
    poison.write_text(json.dumps(POISON))
    assert sessions_listed(page, lambda ids: ids == [good_id]) == [good_id]
    page.set_input_files("#import-file input[type=file]", str(poison))
    wait_text(page, '#manage-status', 'Import refused', 30_000)
    assert "session.request.lanes.0.name" in page.locator("#manage-status").inner_text()

    # The page, the list and share links all keep working, for this visitor and a new one.
    page.reload()
    assert sessions_listed(page, lambda ids: ids == [good_id]) == [good_id]
    assert "Error" not in page.locator("#sessions-table").inner_text()
    other = open_page(browser, link, context=browser.new_context())
    wait_text(other, '#replay-status', 'step 7 of 7', 30_000)

    # A valid export comes back as a new, imported session in this browser's list.
    from storage import SessionStore, make_engine

    exported = tmp_path / "good.json"
    exported.write_text(json.dumps(SessionStore(make_engine(studio["database_url"])).export(good_id)))
    page.set_input_files("#import-file input[type=file]", str(exported))
    wait_text(page, '#manage-status', 'Imported as', 30_000)
    listed = sessions_listed(page, lambda ids: len(ids) == 2)
    assert len(listed) == 2 and listed[1] == good_id
    table = page.locator("#sessions-table").inner_text()
    assert table.index("imported") < table.index(good_id)  # the newest row is the import

    # a file over the import limit reaches the import, whose reason stays on screen (not a toast that vanishes)
    from storage.schema import max_import_bytes

    page.reload()
    sessions_listed(page, lambda ids: len(ids) == 2)  # back on the Sessions tab
    large = tmp_path / "large.json"
    large.write_bytes(b" " * (max_import_bytes() + 1))
    page.set_input_files("#import-file input[type=file]", str(large))
    wait_text(page, '#manage-status', 'larger than the import limit', 60_000)


def test_a_second_browser_sees_none_of_the_first_browsers_sessions(studio, browser):
    first = open_page(browser, studio["url"], context=browser.new_context())
    first.fill("#prompt textarea", "A private question about owls. " * 10)
    set_number(first, "max-new", 6)
    first.click("#generate")
    session_id = share_link(first).split("session=")[1]
    wait_done(first)
    assert session_id in sessions_listed(first, lambda ids: session_id in ids)

    second = open_page(browser, studio["url"], context=browser.new_context())
    assert_no_sessions_listed(second)
    assert session_id not in second.content() and "owls" not in second.content()

    # Deleting from the browser that made it needs no token.
    first.fill("#manage-id textarea, #manage-id input", session_id)
    first.click("#delete-session")  # asks first: nothing is deleted yet
    wait_text(first, '#manage-status', 'for good?', 30_000)
    assert session_id in sessions_listed(first)
    first.click("#confirm-delete")
    wait_text(first, '#manage-status', 'Deleted.', 30_000)
    assert session_id not in sessions_listed(first, lambda ids: session_id not in ids)


def test_stop_keeps_a_queued_run_from_starting_and_a_closed_tab_stops_its_run(studio, browser):
    from storage import SessionStore, make_engine

    store = SessionStore(make_engine(studio["database_url"]))
    busy = open_page(browser, studio["url"], context=browser.new_context())
    pick_example(busy, "Needle in ~2K tokens of Austen (retrieval)")
    set_number(busy, "max-new", 512)
    busy.click("#generate")
    busy_id = share_link(busy).split("session=")[1]

    queued = open_page(browser, studio["url"], context=browser.new_context())
    queued.fill("#prompt textarea", "I wait in the queue.")
    queued.click("#generate")
    wait_text(queued, '#status', 'Waiting for a free slot')
    queued.wait_for_function("/queue: \\d+\\/\\d+/.test(document.querySelector('#status').innerText)")
    queued.click("#stop")
    wait_text(queued, '#status', 'will not start')

    busy.close()  # the tab goes away mid-run: its run stops and is marked so
    deadline = time.time() + 60
    while store.get(busy_id)["status"] == "running" and time.time() < deadline:
        time.sleep(0.5)
    assert store.get(busy_id)["status"] == "stopped"
    assert len(store.events(busy_id)) > 0
    # "Stopped" is already on screen from the click: wait for the queued run's own last word, not for that.
    wait_text(queued, '#status', 'before it started', 60_000)
    status = queued.locator("#status").inner_text()
    assert "before it started: nothing was run" in status
    assert_no_sessions_listed(queued)


def open_link_seconds(page, link: str) -> float:
    """Seconds from asking for a share link to its replay drawn at its last step (7 of 7 here)."""
    began = time.monotonic()
    page.goto(link)
    wait_text(page, "#replay-status", "step 7 of 7", 30_000)
    return time.monotonic() - began


def test_a_heavy_import_is_refused_fast_a_failing_diagnosis_says_why_and_lanes_can_be_timed(studio, browser, tmp_path):
    from storage import SessionStore, make_engine

    first = browser.new_context()
    page = open_page(browser, studio["url"], context=first)
    page.fill("#prompt textarea", "A question about lanterns and harbors. " * 12)
    set_number(page, "max-new", 8)
    page.click("#generate")
    link = share_link(page)
    assert "Done." in wait_done(page)
    good_id = link.split("session=")[1]
    store = SessionStore(make_engine(studio["database_url"]))
    doc = store.export(good_id)

    # A window id far past the session's own tokens: refused at the door, with the reason, nothing stored; a
    # second visitor's share link opens meanwhile as fast as ever.
    heavy = json.loads(json.dumps(doc))
    next(e for e in heavy["events"] if e["kind"] == "routing")["scores"]["299999"] = 0.5
    path = tmp_path / "heavy.json"
    path.write_text(json.dumps(heavy))
    other = open_page(browser, "about:blank", context=browser.new_context())
    alone = open_link_seconds(other, link)  # this machine's time to open the link with nothing else going on
    page.click("button[role=tab]:has-text('Sessions')")
    began = time.monotonic()
    page.set_input_files("#import-file input[type=file]", str(path))
    beside = open_link_seconds(other, link)
    wait_text(page, "#manage-status", "Import refused", 30_000)
    refused = time.monotonic() - began
    assert "names window 299999" in page.locator("#manage-status").inner_text()
    # Under 2 s on a quiet machine; a loaded one stretches every page alike, so the bound follows the lone open.
    # (Before the door check, this import took 43 s and held the other visitor's page for 36 s.)
    bound = max(2.0, 3 * alone)
    assert beside <= bound and refused <= bound + alone, (alone, beside, refused)

    # A run this model cannot redo (another model's token ids) is diagnosed in words, on its own page.
    alien = json.loads(json.dumps(doc))
    for e in alien["events"]:
        if e["kind"] == "token":
            e["token_id"] = 9_999_999
    path = tmp_path / "alien.json"
    path.write_text(json.dumps(alien))
    page.reload()  # the file box holds the refused file: a fresh page has an empty one
    page.click("button[role=tab]:has-text('Sessions')")
    page.set_input_files("#import-file input[type=file]", str(path))
    wait_text(page, "#manage-status", "Imported as", 30_000)
    alien_id = re.search(r"Imported as ([\w-]{22})", page.locator("#manage-status").inner_text()).group(1)
    replay = open_page(browser, f"{studio['url']}/?session={alien_id}", context=first)
    wait_text(replay, "#replay-status", "imported", 30_000)
    replay.click("#replay-diagnose")
    wait_text(replay, "#replay-diagnostics", "outside this model's vocabulary", 60_000)

    # Time the lanes alone: every lane of the run, measured interleaved, with its ratio to FullKV.
    other.click("#replay-time")
    wait_text(other, "#replay-timing", "× fullkv", 120_000)
    timing = other.locator("#replay-timing").inner_text()
    assert all(lane in timing for lane in ("fullkv", "snapkv", "qevict"))
