"""The studio's example data, rebuilt: the Austen text its prompts (and the RULER haystack) are cut from, and the
needle prompt of its promotion example.

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/jane
    pip install rdata && python -m bench.studio_data austen /tmp/jane      # writes ui/data/austen.txt
    python -m bench.studio_data promotion --threads 2                      # writes ui/promotion_example.json

``austen``: Debian's r-cran-janeaustenr package (public-domain novels) stores the novels as an R lazy-load database
(Rdata.rdx index, Rdata.rdb records); each record is a 4-byte length, then zlib data (or a type byte for bzip2/xz)
of an R-serialized character vector of lines. A maintainer's script: ``rdata`` is no dependency of the project.

``promotion``: a needle prompt on which QEvict, at the studio's defaults, demotes a window and promotes it back
while it answers, and both FullKV and QEvict find the answer. Candidates are tried in a fixed order (passage start
in Pride and Prejudice x needle depth), each through the studio's own run (lanes FullKV, SnapKV, QEvict at
QEvictConfig()'s defaults but for the budget, ``--budget``: at the default's 20% of a 16-bit cache its low-bit tier
takes every byte and no window is full, so none can be promoted; greedy); the first that qualifies is written, with
the layer, the window and the steps of its demotion and promotion. The rule is fixed before the search: FullKV and
QEvict contain the answer; some layer has a window in an event's ``demoted`` at a decode step and in a later
event's ``promoted``.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
import zlib
from pathlib import Path

from .common import add_model_args, setup

ROOT = Path(__file__).resolve().parents[1]
NOVELS = ("prideprejudice", "persuasion")
KEEP_CHARS = 160_000  # per novel: enough for 8K-token haystacks, small enough to commit
STARTS = (0, 40000, 80000, 120000, 160000, 200000, 240000)  # the promotion example's candidates, tried in order
DEPTHS = (0.25, 0.5, 0.75)
KEY, VALUE, NEW_TOKENS = "lantern", "4738291", 48


def _record(blob: bytes) -> bytes:
    kind = blob[4:5]
    if kind == b"Z":
        return lzma.decompress(blob[5:])
    if kind == b"2":
        return bz2.decompress(blob[5:])
    if kind == b"0":
        return blob[5:]
    return zlib.decompress(blob[4:])


def paragraphs(lines: list[str]) -> list[str]:
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return out


def austen(root: str) -> None:
    import rdata

    base = Path(root) / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((base.with_suffix(".rdx")).read_bytes())))
    db = base.with_suffix(".rdb").read_bytes()
    texts = []
    for name in NOVELS:
        offset, length = (int(v) for v in index["variables"][name])
        lines = [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(_record(db[offset:offset + length])))]
        text = "\n\n".join(paragraphs(lines))
        texts.append(text[:text.rfind("\n\n", 0, KEEP_CHARS)])
    out = ROOT / "ui" / "data" / "austen.txt"
    out.write_text("\n\n".join(texts) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")



def demoted_then_promoted(view, lane: str) -> tuple[int, int, int, int] | None:
    """(layer, window, step demoted, step promoted) of the first round trip of the lowest layer that has one: a
    window demoted during decoding, then promoted back (what the studio's moves list names)."""
    from ui.cards import round_trips

    for layer, events in sorted(view.routing[lane].items()):
        trips = round_trips(events)
        if trips:
            return (layer, *min(trips, key=lambda trip: trip[2]))
    return None


def promotion(args) -> None:
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.studio_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="data", required=True)
    text = sub.add_parser("austen", help="ui/data/austen.txt from r-cran-janeaustenr, unpacked in ROOT")
    text.add_argument("root", nargs="?", default="/tmp/jane")
    example = sub.add_parser("promotion", help="ui/promotion_example.json: the first needle prompt that qualifies")
    example.add_argument("--out", default=str(ROOT / "ui" / "promotion_example.json"))
    example.add_argument("--budget", type=float, default=0.4, help="the example's KV budget (it sets the form's)")
    add_model_args(example)
    args = parser.parse_args(argv)
    austen(args.root) if args.data == "austen" else promotion(args)


if __name__ == "__main__":
    main()
