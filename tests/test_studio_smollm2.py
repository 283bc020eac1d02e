"""The studio on the bundled SmolLM2 (slow: loads the model): docs/studio.md's gradio_client snippet runs as printed,
every example shows in the browser what it says at the defaults (every lane at the asked budget, FullKV right, the
promotion), and the lanes timed alone agree with bench.tpot."""

import json
import re
from pathlib import Path

import pytest

from tests.browser import chromium, free_port, need_chromium, open_page, pick_example
from ui.examples import EXAMPLES, PROMOTION
from ui.form import Controls, parse_request

pytestmark = pytest.mark.slow
STUDIO_DOC = Path(__file__).resolve().parents[1] / "docs" / "studio.md"  # the API snippet the README points to


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


def test_the_documented_gradio_client_snippet_runs_as_printed(smollm2_studio, capsys):
    url, _ = smollm2_studio
    block = next(b for b in re.findall(r"```python\n(.*?)```", STUDIO_DOC.read_text(), re.S) if "gradio_client" in b)
    assert 'Client("http://127.0.0.1:7860/")' in block
    scope: dict = {}
    exec(compile(block.replace("http://127.0.0.1:7860/", url), "docs/studio.md", "exec"), scope)
    printed = capsys.readouterr().out.strip().splitlines()[-1]  # gradio_client first says "Loaded as API"
    assert printed.startswith("**Done.**"), printed[:300]
    assert scope["stats"]["headers"] == ["measure", "fullkv", "snapkv", "qevict"]
    rows = {row[0]: row[1:] for row in scope["stats"]["data"]}
    assert rows["tokens"][0] > 0 and all(t > 0 for t in rows["tokens"])
    assert "/?session=" in scope["share"]


@pytest.fixture(scope="module")
def browser():
    need_chromium()
    with chromium() as (launched, outside):
        yield launched
    assert outside == [], f"requests left 127.0.0.1: {outside[:5]}"


@pytest.mark.browser
@pytest.mark.timeout(1800)  # a loaded machine: the 256-token continuation of three lanes takes minutes there
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_shows_what_it_says_in_the_browser(smollm2, smollm2_studio, browser, name):
    """Each example picked in the browser and run at the studio's defaults: no lane raised above the asked budget,
    FullKV finds the expected answer, the promotion example's moves list and tier map show the round trip, and the
    long continuation does not loop (greedy, every lane repeated one sentence: a quarter of its 4-grams distinct)."""
    from tests.test_studio_browser import wait_done

    url, _ = smollm2_studio
    page = open_page(browser, url)
    pick_example(page, name)
    page.click("#generate")
    status = wait_done(page, timeout=1_700_000)
    assert "Done." in status, status
    cards = page.locator("#lanes .qe-lane")
    assert cards.count() == 3
    assert cards.locator(".qe-note").count() == 0, f"{name}: a lane runs at another budget than the one asked"
    example = EXAMPLES[name]()
    budget = 100 * example.budget  # each example sets its own (the promotion one another than the default)
    # The card's share is of FullKV's bytes at the tokens a lane has read; the budget is a share of FullKV's at the
    # run's max_length. A lane that stopped early reads fewer, so its bound is the budget scaled by the two lengths.
    tok = smollm2[1]
    text = tok.apply_chat_template([{"role": "user", "content": example.prompt}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = len(tok(text, add_special_tokens=False).input_ids)  # as the studio encodes it
    for i in (1, 2):  # snapkv and qevict: their measured bytes within the budget
        stats = cards.nth(i).locator(".qe-stats").inner_text()
        share, new = re.search(r"= ([\d.]+)% of FullKV", stats), int(re.search(r"(\d+) tokens", stats).group(1))
        bound = budget * (prompt + example.max_new_tokens) / (prompt + new - 1)
        assert share and float(share.group(1)) <= bound + 0.05, (name, share and share.group(0), bound)
    if example.expected:
        assert "✓ found the answer" in cards.nth(0).locator(".qe-answer").inner_text(), name
    if example.max_new_tokens >= 256:  # the drift example: FullKV's own text moves on
        words = cards.nth(0).locator(".qe-text").inner_text().split()
        grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
        assert len(grams) > 100 and len(set(grams)) >= 0.8 * len(grams), " ".join(words)[:600]
    if example.layer is not None:  # the promotion example opens on its layer, showing QEvict
        found = json.loads(PROMOTION.read_text())
        moves = page.locator("#moves").inner_text()
        assert f"window {found['window']} " in moves and "promoted back" in moves, moves[:600]
        promoted = page.evaluate("""() => [...document.querySelectorAll('#tier-map .js-plotly-plot')]
            .flatMap(plot => plot.data).filter(trace => trace.name === 'promoted ▲').flatMap(trace => trace.y)""")
        assert found["window"] in promoted, promoted


@pytest.mark.browser
def test_the_lanes_timed_alone_agree_with_bench_tpot(smollm2, smollm2_studio, browser):
    """The studio's "Time the lanes alone" table, clicked in the browser on a replay of the needle example (2K
    tokens, the default lanes), and bench.tpot on the same prompt: QEvict's time per token over FullKV's agrees
    within 0.15 of the range of three bench.tpot rounds. Both interleave every lane's decode steps in one process
    (qevict_core.timing); on a quiet 2-core machine the ratio of one round moves by a few hundredths between rounds,
    so 0.15 is above that noise and below the difference the lane cards once showed (1.11x in the studio against
    0.80-0.90x in bench.tpot)."""
    from bench.tpot import decode_side_by_side
    from qevict_core import QEvictConfig
    from storage import SessionStore, make_engine
    from tests.browser import set_number
    from tests.test_studio_browser import share_link, wait_done, wait_text
    from ui.studio import Studio

    url, _ = smollm2_studio
    name = next(iter(EXAMPLES))
    page = open_page(browser, url)
    pick_example(page, name)
    set_number(page, "max-new", 2)
    page.click("#generate")
    link = share_link(page)
    assert "Done." in wait_done(page, timeout=900_000)
    page.goto(link)
    page.click("#replay-time")
    wait_text(page, "#replay-timing", "× fullkv", 900_000)
    shown = {row[0]: float(row[2]) for row in page.evaluate(
        "[...document.querySelectorAll('#replay-timing tbody tr')].map(r => [...r.cells].map(c => c.innerText))")}

    example, d = EXAMPLES[name](), QEvictConfig()
    req = parse_request(Controls.lanes(["fullkv", "qevict"], prompt=example.prompt, max_new_tokens=2))
    input_ids = Studio(*smollm2, SessionStore(make_engine("sqlite://"))).prepare(req)[0]
    lanes = [("fullkv", None), ("qevict", d.budget)]
    decode_side_by_side(smollm2[0], input_ids[:, :512], lanes, 9)  # warm-up, as bench.tpot does
    ratios = []
    for _ in range(3):  # bench.tpot's rounds: their spread is this machine's noise right now
        steps = decode_side_by_side(smollm2[0], input_ids, lanes, 33)
        tpot = {lane: sum(s for s, _ in st) / len(st) for lane, st in steps.items()}
        ratios.append(tpot["qevict"] / tpot["fullkv"])
    assert shown["fullkv"] == 1.0 and set(shown) == {"fullkv", "snapkv", "qevict"}
    # Within 0.15 of the rounds' range: one round on a machine shared with two benchmarks once differed from
    # another by 0.15 on its own, and the range widens with such load; the bug this guards against put the
    # studio's ratio 0.2-0.3 outside bench.tpot's on a quiet machine.
    assert min(ratios) - 0.15 <= shown["qevict"] <= max(ratios) + 0.15, (shown, ratios)
