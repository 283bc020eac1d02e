"""How long a studio visitor waits: the time to the first generated token and to the end of a run, for every
example at its own settings on the default lanes, through the same handlers the example picker and the Generate
button call (Gradio's transport excluded), or with ``--browser`` in Debian's chromium against the studio served on
this machine (what a visitor sees: from the click on Generate to the first "Generating" status, and to "Done").

    python -m bench.studio_latency --rounds 2 --threads 2 --out bench/results/studio_latency
    python -m bench.studio_latency --browser --rounds 2 --threads 2 --out bench/results/studio_latency
    python -m bench.studio_latency --busy 2 --rounds 2 --threads 2 --out bench/results/studio_latency
    python -m bench.studio_latency --time-lanes --rounds 3 --threads 1 --out bench/results/studio_lanes

``--busy N`` keeps N other processes spinning on the CPU for the whole run: the studio on a machine it shares
(benchmarks often run beside it), the same load every time.

One JSON line per (example, round): seconds to the first "Generating" update and to "Done", the new tokens the
example asks for, each lane's measured share of FullKV's bytes and whether it found the expected answer, the
machine's load average when the run started (benchmarks often share the machine: the row says how busy it was),
``busy`` (the spinning processes ``--busy`` started) and ``through`` ("handlers" or "browser").

``--time-lanes``: after each example's run, its "Time the lanes alone" (the Replay tab's button, as a visitor
presses it: ``Studio.time_lanes`` at its defaults, what ``bench.tpot`` measures on the run's own prompt), pressed
``--rounds`` times; one JSON line per press into ``studio_lanes.jsonl``: each lane's ms per token and its ratio to
the FullKV lane.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .common import RESULTS, add_model_args, append_jsonl, dtype_name, setup

DEFAULT_LANES = ("fullkv", "snapkv", "qevict")


def measure(handlers, example) -> dict:
    """One run of a picked example (``ExampleOutputs``: its text and its own settings) on the default lanes ->
    timings and what each lane showed."""
    from ui.form import Controls
    from ui.outputs import Shown

    controls = Controls.lanes(list(DEFAULT_LANES), prompt=example.prompt, max_new_tokens=example.max_new_tokens,
                              expected=example.expected, budget=example.budget, temperature=example.temperature,
                              seed=example.seed)
    start, first, last, session = time.perf_counter(), None, None, None
    for last in handlers.generate(controls, Shown(layer=handlers.pickers.layers // 2)):
        if first is None and last.status.startswith("**Generating"):
            first = time.perf_counter() - start
        if isinstance(last.ref, dict) and "id" in last.ref:  # the new run's session, for this browser's list
            session = last.ref["id"]
    total = time.perf_counter() - start
    found, kv_percent = lanes_shown(last.view.lanes, example.expected)
    return {"first_token_s": first, "total_s": total, "status": last.status, "found": found, "kv_percent": kv_percent,
            "session": session}


def lanes_shown(cards_html: str, expected: str) -> tuple[dict, dict]:
    """The lane cards' HTML -> (found the answer per lane, % of FullKV's bytes per lane)."""
    found, kv_percent = {}, {}
    for block in cards_html.split('<div class="qe-lane" data-lane="')[1:]:  # one lane card each
        lane = block.split('"', 1)[0]
        found[lane] = "found the answer" in block if expected else None
        share = re.search(r"= ([0-9.]+)% of FullKV", block)
        kv_percent[lane] = float(share.group(1)) if share else None
    return found, kv_percent


def measure_in_browser(page, url: str, name: str, expected: str) -> dict:
    """A fresh page of the studio: pick the example, click Generate, wait for the status to say so."""
    status = "document.querySelector('#status')?.innerText ?? ''"
    page.goto(url)
    page.locator("#example input").click()
    page.get_by_role("option", name=name, exact=True).click()
    page.wait_for_function("document.querySelector('#prompt textarea').value.length > 0")
    start = time.perf_counter()
    page.click("#generate")
    page.wait_for_function(f"({status}).includes('Generating')", timeout=0, polling=50)
    first = time.perf_counter() - start
    page.wait_for_function(f"['Done.', 'Stopped', 'Error', 'Cannot run'].some(w => ({status}).includes(w))",
                           timeout=0, polling=50)
    total = time.perf_counter() - start
    found, kv_percent = lanes_shown(page.locator("#lanes").inner_html(), expected)
    return {"first_token_s": first, "total_s": total, "status": page.locator("#status").inner_text(),
            "found": found, "kv_percent": kv_percent}


@contextmanager
def studio_in_chromium(model, tokenizer, model_name: str):
    """-> (page, url): the studio on a free local port over a throwaway SQLite file, and a chromium page."""
    import tempfile

    from playwright.sync_api import sync_playwright

    import app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ["GRADIO_SERVER_PORT"] = str(port)
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        demo = app.create_demo(model, tokenizer, f"sqlite:///{folder}/latency.sqlite", model_name)
        app.launch(demo, prevent_thread_lock=True)
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium",
                                             args=["--no-sandbox", "--headless", "--disable-gpu"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 800}), f"http://127.0.0.1:{port}/"
        finally:
            browser.close()
            demo.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.studio_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "studio_latency"))
    parser.add_argument("--browser", action="store_true", help="click through Debian's chromium (/usr/bin/chromium)")
    parser.add_argument("--busy", type=int, default=0, help="processes kept spinning on the CPU while it runs")
    parser.add_argument("--examples", default=None, help="comma-separated example names (default: all)")
    parser.add_argument("--time-lanes", action="store_true",
                        help="after each run, press its \"Time the lanes alone\" --rounds times (studio_lanes.jsonl)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    from qevict_core import QEvictConfig
    from storage import SessionStore, make_engine
    from ui.examples import EXAMPLES
    from ui.control import TabRuns
    from ui.run_tab import RunHandlers
    from ui.studio import Studio

    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    # The form has no storage control: every lane stores what the config's default gives this model
    meta["kv_dtype"] = dtype_name(QEvictConfig().storage_dtype(model.dtype))
    handlers = RunHandlers(Studio(model, tokenizer, SessionStore(make_engine("sqlite://")), meta["model"]), TabRuns())
    out = Path(args.out) / "studio_latency.jsonl"
    names = example_names(args.examples, EXAMPLES) if args.examples else list(EXAMPLES)
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        parser.error(f"unknown examples {unknown}; choose from {list(EXAMPLES)}")
    if args.time_lanes:
        if args.browser:
            parser.error("--time-lanes presses the button through the handlers: leave out --browser")
        for name in names:
            time_lanes(handlers, name, args.rounds, Path(args.out) / "studio_lanes.jsonl", meta)
        return
    with studio_in_chromium(model, tokenizer, meta["model"]) if args.browser else nullcontext() as served, \
            spinning(args.busy):
        for round_ in range(args.rounds):
            for name in names:
                example = handlers.pick_example(name)  # what the picker fills in
                load = os.getloadavg()[0]
                timed = (measure_in_browser(*served, name, example.expected) if served else
                         measure(handlers, example))
                timed.pop("session", None)
                row = {"example": name, "round": round_, "through": "browser" if served else "handlers",
                       "busy": args.busy, "load_1min": load, "max_new_tokens": example.max_new_tokens, **timed, **meta}
                report(out, row)


def example_names(text: str, known) -> list[str]:
    """Comma-separated example names, where a name may hold a comma itself ("A window demoted, then promoted
    back"): pieces are joined while they begin a known name; what makes none is returned as written."""
    names, piece = [], ""
    for part in text.split(","):
        piece = f"{piece},{part}" if piece else part
        if piece.strip() in known or not any(name.startswith(piece.strip() + ",") for name in known):
            names.append(piece.strip())  # a known name, or one no further piece can complete
            piece = ""
    return names + ([piece.strip()] if piece else [])


def time_lanes(handlers, name: str, presses: int, out: Path, meta: dict) -> None:
    """One run of example ``name`` on the default lanes, then its "Time the lanes alone" pressed ``presses`` times."""
    run = measure(handlers, handlers.pick_example(name))
    if run["session"] is None or not run["status"].startswith("**Done"):
        raise RuntimeError(f"{name}: the run did not finish ({run['status'][:200]})")
    for press in range(presses):
        timing = handlers.studio.time_lanes(run["session"])
        row = {"example": name, "press": press, "prompt_tokens": timing.prompt_tokens, "steps": timing.steps,
               "baseline": timing.baseline, "lanes": timing.lanes, "load_1min": os.getloadavg()[0], **meta}
        append_jsonl(out, row)
        print(f"{name[:40]:40s} " + ", ".join(f"{lane} {1000 * t['tpot']:.1f} ms (x{t['ratio']:.3f})"
                                             for lane, t in timing.lanes.items()), flush=True)


def lanes_table(rows: list[dict]) -> str:
    """Per example: each lane's median ms per token over the presses and its ratio to the baseline lane (median,
    with the range over presses)."""
    from statistics import median

    lines = ["| commit | example | prompt tokens | presses | lane | ms per token, alone | × FullKV [range] |",
             "|---|---|---|---|---|---|---|"]
    for commit, name in dict.fromkeys((r["commit"], r["example"]) for r in rows):
        group = [r for r in rows if (r["commit"], r["example"]) == (commit, name)]
        for lane in group[0]["lanes"]:
            ratios = [r["lanes"][lane]["ratio"] for r in group]
            lines.append(f"| {commit} | {name} | {group[0]['prompt_tokens']:,} | {len(group)} | {lane} | "
                         f"{1000 * median(r['lanes'][lane]['tpot'] for r in group):.1f} | {median(ratios):.3f} "
                         f"[{min(ratios):.3f}–{max(ratios):.3f}] |")
    first = rows[0]
    return (f"{first['model']} on {first['cpu']} ({first['threads']} threads), {first['date']}: the studio's \"Time "
            f"the lanes alone\" after each example's run on the default lanes, {first['steps']} decode steps of "
            "every lane interleaved per press; medians over presses.\n\n" + "\n".join(lines) + "\n")


def _spin(started) -> None:
    started.set()
    while True:
        pass


@contextmanager
def spinning(processes: int):
    """``processes`` other processes busy on the CPU until the block ends. Yields once each one spins: a spawned
    interpreter spends its first moments importing, often waiting on the disk, which is no load."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    events = [context.Event() for _ in range(processes)]
    spinners = [context.Process(target=_spin, args=(event,), daemon=True) for event in events]
    for spinner in spinners:
        spinner.start()
    try:
        for spinner, event in zip(spinners, events):
            while not event.wait(1.0):
                if not spinner.is_alive():
                    raise RuntimeError(f"a spinning process ended before it spun (exit code {spinner.exitcode})")
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def report(out: Path, row: dict) -> None:
    append_jsonl(out, row)
    print(f"{row['through']:8s} {row['example'][:40]:40s} first token {row['first_token_s']:.1f} s, done "
          f"{row['total_s']:.1f} s, load {row['load_1min']:.1f}, found {row['found']}", flush=True)


def table(rows: list[dict]) -> str:
    """Per example: median seconds to the first token and to the end over rounds, the busiest load seen, and
    whether each lane found the answer in every round."""
    from statistics import median

    def cell(r: dict) -> tuple:
        return r["commit"], r["example"], r.get("through", "handlers"), r.get("busy", 0)

    lines = ["| commit | example | through | other busy processes | new tokens | rounds | first token s | "
             "whole run s | load (1 min, max) | found the answer |", "|---|---|---|---|---|---|---|---|---|---|"]
    for commit, name, through, busy in dict.fromkeys(map(cell, rows)):
        group = [r for r in rows if cell(r) == (commit, name, through, busy)]
        lanes = dict.fromkeys(lane for r in group for lane in r["found"])
        found = ", ".join(f"{lane} {sum(bool(r['found'].get(lane)) for r in group)}/{len(group)}" for lane in lanes
                          if any(r["found"].get(lane) is not None for r in group)) or "—"
        lines.append(f"| {commit} | {name} | {through} | {busy} | {group[0]['max_new_tokens']} | {len(group)} | "
                     f"{median(r['first_token_s'] for r in group):.1f} | {median(r['total_s'] for r in group):.1f} | "
                     f"{max(r['load_1min'] for r in group):.1f} | {found} |")
    first = rows[0]
    commits = ", ".join(dict.fromkeys(r["commit"] for r in rows))
    return (f"{first['model']} on {first['cpu']} ({first['threads']} threads), {first['date']}, commit "
            f"{commits}; medians over rounds, each example at its own settings on the default lanes ("
            f"{', '.join(DEFAULT_LANES)}).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
