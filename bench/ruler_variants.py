"""QEvict configurations side by side on the RULER-style prompts of ``bench.ruler`` (same seeds, same scoring).

    python -m bench.ruler_variants --variants '{"int4": {"bits": 4}, "int4_q85": {"bits": 4, "q_frac": 0.85}}' \\
        --budget 0.1 --length 2048 --out bench/results/ruler_variants/int4_10pct.jsonl

``bench.ruler`` compares registered methods; this compares configurations of QEvict, each variant a set of
``QEvictConfig`` fields over ``QEvictConfig(budget=--budget)``, plus a FullKV lane. A variant with
``"per_head": β`` routes every KV head on its own (``HeadwiseQEvictCache``, ``qevict_head``'s cache, β its blend
with the layer's ranking); the others route per layer (``QEvictCache``). All lanes of a sample share its prefill.
One JSON line per (variant, task, sample); the averages are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections import defaultdict
from pathlib import Path

from qevict_core import Lane, QEvictConfig, make_cache
from qevict_core.cache import QEvictCache
from qevict_core.head_cache import HeadwiseQEvictCache

from .common import add_model_args, append_jsonl, default_device, parse_shard, read_jsonl, setup
from .ruler import decode_until_answered, sized_sample
from .ruler_tasks import DEFAULT_TASKS, TASKS, string_match_all


def configs(variants: dict, budget: float) -> dict[str, QEvictConfig]:
    """A variant's ``"per_head": β`` is its ``head_blend``."""
    base = QEvictConfig(budget=budget).to_dict()
    return {name: QEvictConfig.from_dict({**base, **{k: v for k, v in fields.items() if k != "per_head"},
                                          **({"head_blend": fields["per_head"]} if "per_head" in fields else {})})
            for name, fields in variants.items()}


def build(model, config: QEvictConfig, max_length: int, per_head: float | None):
    if per_head is None:
        return QEvictCache(model, config, max_length)
    return HeadwiseQEvictCache(model, config, max_length)


def run(args) -> None:
    fields = json.loads(args.variants)
    variants = configs(fields, args.budget)
    tasks = list(DEFAULT_TASKS) if args.tasks == "default" else args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; allowed: default or {sorted(TASKS)}")
    shard, shards = parse_shard(args.shard)
    model, tokenizer, meta = setup(args.model, args.device or default_device(), args.threads)
    items = [(t, s) for t in tasks for s in range(args.samples)][shard::shards]
    for task, sample_idx in items:
        seed = zlib.crc32(f"{task}/{args.length}/{sample_idx}/{args.seed}".encode())
        sample, ids = sized_sample(tokenizer, task, args.length, seed, None, "auto")
        max_length = ids.shape[1] + sample.max_new_tokens
        lanes = {"fullkv": Lane("fullkv", make_cache("fullkv", model, QEvictConfig(budget=1.0), max_length))}
        lanes.update({name: Lane(name, build(model, cfg, max_length, fields[name].get("per_head")))
                      for name, cfg in variants.items()})
        decode_until_answered(model, tokenizer, ids, list(lanes.values()), sample)
        for name, lane in lanes.items():
            summary = lane.cache.summary()
            append_jsonl(Path(args.out), {
                "variant": name, "config": variants[name].to_dict() if name in variants else None,
                "per_head": fields[name].get("per_head") if name in variants else None,
                "task": task, "length": args.length, "sample": sample_idx, "seed": seed,
                "score": string_match_all(lane.text, sample.answers), "prediction": lane.text[:200],
                "kv_ratio": lane.cache.memory_report()["ratio"], "k_full": summary.get("k_full"),
                "k_quant": summary.get("k_quant"), **meta})


def averages(path: Path) -> dict[str, tuple[float, int]]:
    scores = defaultdict(list)
    for row in read_jsonl([path]):
        scores[row["variant"]].append(row["score"])
    return {name: (100 * sum(s) / len(s), len(s)) for name, s in scores.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ruler_variants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", required=True, help='JSON: {"name": {QEvictConfig field: value, ...}, ...}')
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tasks", default="default")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", default=None, help="i/n: every n-th (task, sample), from the i-th")
    parser.add_argument("--out", required=True, help="JSONL file; shards may append to the same one")
    add_model_args(parser)
    parser.add_argument("--report", action="store_true", help="only print the averages of --out")
    args = parser.parse_args(argv)
    if not args.report:
        run(args)
    for name, (score, n) in sorted(averages(Path(args.out)).items()):
        print(f"{name:<16} {score:5.1f}  ({n} samples)")


if __name__ == "__main__":
    main()
