"""Where the answer sits after the prompt's routing event: the tier of its windows in every layer.

    python -m bench.needle_tiers --task niah_multikey_1 --samples 0,2,4 --budget 0.2 --bits 2,4

For one RULER-style prompt of ``bench.ruler`` (same seed), QEvict (the default config at ``--budget``, with each
``--bits``) reads the prompt and decodes a few tokens; the prompt's routing event says, per layer, whether the
windows holding the first answer's tokens went to the full tier, the low-bit tier or out. Tells a lost needle
(evicted everywhere) from one kept but misread.
"""

from __future__ import annotations

import argparse
import zlib
from collections import Counter

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes
from qevict_core.engine.cache import QEvictCache

from .common import add_model_args, default_device, setup
from .ruler_tasks import sized_sample


def answer_span(tokenizer, ids: list[int], answer: str) -> tuple[int, int]:
    """The shortest token span [i, j) whose text contains ``answer``."""
    for i in range(len(ids)):
        j = next((j for j in range(i + 1, min(i + 16, len(ids)) + 1) if answer in tokenizer.decode(ids[i:j])), None)
        if j is not None:
            while answer in tokenizer.decode(ids[i + 1:j]):
                i += 1
            return i, j
    raise ValueError(f"answer {answer!r} not found in the prompt's tokens")


def tiers(model, tokenizer, ids, config: QEvictConfig, span: tuple[int, int], max_length: int):
    cache = QEvictCache(model, config.replace(record_events=True), max_length)
    lane = Lane("qevict", cache)
    first = {}
    for event in generate_lanes(model, tokenizer, ids, [lane], Sampling(max_new_tokens=12)):
        if event.kind == "routing":
            first.setdefault(event.layer, event)
    windows = sorted({cache.grid.window_of(p) for p in range(*span)})
    counts = Counter("full" if w in e.full else "low-bit" if w in e.quantized else "evicted"
                     for e in first.values() for w in windows)
    return windows, counts, lane.text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.needle_tiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_multikey_1")
    parser.add_argument("--samples", default="0")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--bits", default="2,4")
    parser.add_argument("--seed", type=int, default=0)
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, tokenizer, _ = setup(args.model, args.device or default_device(), args.threads)
    for sample_idx in (int(s) for s in args.samples.split(",")):
        seed = zlib.crc32(f"{args.task}/{args.length}/{sample_idx}/{args.seed}".encode())
        sample, ids = sized_sample(tokenizer, args.task, args.length, seed, None, "auto")
        span = answer_span(tokenizer, ids[0].tolist(), sample.answers[0])
        for bits in (int(b) for b in args.bits.split(",")):
            config = QEvictConfig(budget=args.budget, bits=bits)
            windows, counts, text = tiers(model, tokenizer, ids, config, span, ids.shape[1] + sample.max_new_tokens)
            print(f"{args.task} sample {sample_idx}, answer {sample.answers[0]} (tokens {span[0]}-{span[1]}, windows "
                  f"{windows}), INT{bits}: layer-windows {dict(counts)}; output {text.strip()[:40]!r}")


if __name__ == "__main__":
    main()
