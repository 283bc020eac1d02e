"""Find the studio's promotion example: a needle prompt on which QEvict, at the studio's defaults, demotes a window
and promotes it back while it answers, and both FullKV and QEvict find the answer.

    python -m bench.promotion_example --threads 2      # writes ui/promotion_example.json

Candidates are tried in a fixed order (passage start in Pride and Prejudice x needle depth), each through the
studio's own run (lanes FullKV, SnapKV, QEvict at QEvictConfig()'s defaults but for the budget, ``--budget``: at the
default's 20% of a 16-bit cache its low-bit tier takes every byte and no window is full, so none can be promoted;
greedy); the first that qualifies is written, with the layer, the window and the steps of its demotion and promotion. The rule is fixed before the
search: FullKV and QEvict contain the answer; some layer has a window in an event's ``demoted`` at a decode step and
in a later event's ``promoted``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import add_model_args, setup

STARTS = (0, 40000, 80000, 120000, 160000, 200000, 240000)
DEPTHS = (0.25, 0.5, 0.75)
KEY, VALUE, NEW_TOKENS = "lantern", "4738291", 48


def demoted_then_promoted(view, lane: str) -> tuple[int, int, int, int] | None:
    """(layer, window, step demoted, step promoted) of the first round trip of the lowest layer that has one: a
    window demoted during decoding, then promoted back (what the studio's moves list names)."""
    from ui.cards import round_trips

    for layer, events in sorted(view.routing[lane].items()):
        trips = round_trips(events)
        if trips:
            return (layer, *min(trips, key=lambda trip: trip[2]))
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.promotion_example", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "ui" / "promotion_example.json"))
    parser.add_argument("--budget", type=float, default=0.4, help="the example's KV budget (it sets the form's)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    from storage import SessionStore, make_engine
    from ui.examples import needle_in_austen
    from ui.form import Controls, parse_request
    from ui.studio import Studio

    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    studio = Studio(model, tokenizer, SessionStore(make_engine("sqlite://")), meta["model"])
    for start in STARTS:
        for depth in DEPTHS:
            prompt = needle_in_austen(key=KEY, value=VALUE, start=start, depth=depth)
            request = parse_request(Controls(prompt=prompt, budget=args.budget, max_new_tokens=NEW_TOKENS,
                                             expected=VALUE))
            view = list(studio.run(request))[-1].view
            found = {name: VALUE in lane.text for name, lane in view.lanes.items()}
            move = demoted_then_promoted(view, "qevict")
            print(f"start {start} depth {depth}: found {found}, demoted then promoted {move}", flush=True)
            if found["fullkv"] and found["qevict"] and move:
                layer, window, down, up = move
                grid = view.grid("qevict")
                text = view.token_text("qevict", grid.start(window), grid.start(window + 1)).strip()
                Path(args.out).write_text(json.dumps(
                    {"start": start, "depth": depth, "key": KEY, "value": VALUE, "max_new_tokens": NEW_TOKENS,
                     "budget": args.budget,
                     "layer": layer, "window": window, "demoted_step": down, "promoted_step": up,
                     "text": text[:60], **meta}, indent=1) + "\n")
                print(f"wrote {args.out}")
                return
    raise SystemExit("no candidate qualified: widen STARTS or DEPTHS")


if __name__ == "__main__":
    main()
