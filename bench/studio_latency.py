"""How long a studio visitor waits: the time to the first generated token and to the end of a run, for every
example at the studio's defaults, through the same handlers the example picker and the Generate button call
(Gradio's transport excluded).

    python -m bench.studio_latency --rounds 2 --threads 2 --out bench/results/studio_latency

One JSON line per (example, round): seconds to the first "Generating" update and to "Done", the new tokens the
example asks for, each lane's measured share of FullKV's bytes and whether it found the expected answer, and the
machine's load average when the run started (benchmarks often share the machine: the row says how busy it was).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from .common import RESULTS, add_model_args, append_jsonl, setup

DEFAULT_LANES = ("fullkv", "snapkv", "qevict")


def measure(handlers, prompt: str, expected: str, max_new_tokens: int) -> dict:
    """One run at the studio's defaults -> timings and what each lane showed."""
    from qevict_core import QEvictConfig

    d = QEvictConfig()
    start, first, last = time.perf_counter(), None, None
    for last in handlers.generate(prompt, *DEFAULT_LANES, d.budget, d.omega, d.q_frac, d.bits, d.sinks, d.recent,
                                  d.scorer, d.promotion, max_new_tokens, 0.0, 0, handlers.layers // 2, expected, 0,
                                  d.coverage or 0.0):
        if first is None and last[0].startswith("**Generating"):
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    found, kv_percent = {}, {}
    for block in last[1].split('<div class="qe-lane" data-lane="')[1:]:  # one lane card each
        lane = block.split('"', 1)[0]
        found[lane] = "found the answer" in block if expected else None
        share = re.search(r"= ([0-9.]+)% of FullKV", block)
        kv_percent[lane] = float(share.group(1)) if share else None
    return {"first_token_s": first, "total_s": total, "status": last[0], "found": found, "kv_percent": kv_percent}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.studio_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "studio_latency"))
    add_model_args(parser)
    args = parser.parse_args(argv)
    from storage import SessionStore, make_engine
    from ui.examples import EXAMPLES
    from ui.handlers import Handlers
    from ui.studio import Studio

    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    handlers = Handlers(Studio(model, tokenizer, SessionStore(make_engine("sqlite://")), meta["model"]))
    out = Path(args.out) / "studio_latency.jsonl"
    for round_ in range(args.rounds):
        for name in EXAMPLES:
            prompt, expected, max_new_tokens, *_ = handlers.pick_example(name)  # what the picker fills in
            load = os.getloadavg()[0]
            row = {"example": name, "round": round_, "load_1min": load, "max_new_tokens": max_new_tokens,
                   **measure(handlers, prompt, expected, max_new_tokens), **meta}
            append_jsonl(out, row)
            print(f"{name[:40]:40s} first token {row['first_token_s']:.1f} s, done {row['total_s']:.1f} s, "
                  f"load {load:.1f}, found {row['found']}", flush=True)


def table(rows: list[dict]) -> str:
    """Per example: median seconds to the first token and to the end over rounds, the busiest load seen, and
    whether each lane found the answer in every round."""
    from statistics import median

    lines = ["| example | new tokens | rounds | first token s | whole run s | load (1 min, max) | found the answer |",
             "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["example"] for r in rows):
        group = [r for r in rows if r["example"] == name]
        lanes = dict.fromkeys(lane for r in group for lane in r["found"])
        found = ", ".join(f"{lane} {sum(bool(r['found'].get(lane)) for r in group)}/{len(group)}" for lane in lanes
                          if any(r["found"].get(lane) is not None for r in group)) or "—"
        lines.append(f"| {name} | {group[0]['max_new_tokens']} | {len(group)} | "
                     f"{median(r['first_token_s'] for r in group):.1f} | {median(r['total_s'] for r in group):.1f} | "
                     f"{max(r['load_1min'] for r in group):.1f} | {found} |")
    first = rows[0]
    return (f"{first['model']} on {first['cpu']} ({first['threads']} threads), {first['date']}, commit "
            f"{first['commit']}; medians over rounds, at the studio's defaults (lanes "
            f"{', '.join(DEFAULT_LANES)}).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
