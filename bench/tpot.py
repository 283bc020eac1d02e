"""Time per output token of several methods decoding side by side in one process, their steps interleaved.

    python -m bench.tpot --methods fullkv,qevict,qevict_head --baseline qevict --context 4096 --new-tokens 64 \\
        --rounds 3 --threads 1 --out bench/results/tpot
    python -m bench.tpot --device cuda --model random:smollm2 --methods fullkv_static,qevict@triton \
        --baseline fullkv_static --graphs   # decode steps replayed from CUDA graphs (qevict_core.generation.graphs)

``bench.speed`` runs every method in a fresh process, which its peak-memory figures need; but on a shared machine
the model's own matrix products ran up to 25% slower in one process than in another started a minute later, which
is more than the differences between QEvict's variants it is meant to show. Here every method's cache is prefilled
in the same process, then each decode step of each method is timed in turn (the order rotates every step), so a
drift in the machine's speed reaches every method within one step of the others. Each round builds the caches
afresh; a method's TPOT is the mean of its steps, its plain step the median of those that do not route, and its
routing event the median extra time of those that do. Ratios to ``--baseline`` are taken within each round, then
the median over rounds is reported with their range. A warm-up decode of every method on a short prompt comes
first. No peak memory: the caches share one allocator (``bench.speed`` measures it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from qevict_core.timing import interleaved_steps

from .common import RESULTS, Variant, add_model_args, kv_dtypes, method_lanes
from .speed import load, prompt_ids, routing_overhead


def decode_side_by_side(model, prompt: torch.Tensor, lanes: list[tuple[str, float | None]],
                        new_tokens: int, graphs: bool = False) -> dict[str, list[tuple[float, bool]]]:
    """A fresh cache per lane, then ``qevict_core.timing.interleaved_steps`` -> per lane its (seconds, routed)."""
    variants = {spec: Variant.parse(spec) for spec, _ in lanes}
    caches = {spec: variants[spec].make_cache(model, budget, prompt.shape[1] + new_tokens) for spec, budget in lanes}
    return interleaved_steps(model, prompt, caches, new_tokens, {spec: v.chunk for spec, v in variants.items()},
                             graphs)


def summarise(steps: list[tuple[float, bool]]) -> dict:
    return {"tpot": sum(s for s, _ in steps) / len(steps), **routing_overhead(steps)}


def run(model, tokenizer, lanes, context: int, new_tokens: int, rounds: int, baseline: str,
        graphs: bool = False) -> list[dict]:
    device = next(model.parameters()).device
    prompt = prompt_ids(tokenizer, model, context, 1, device)
    decode_side_by_side(model, prompt[:, :min(context, 1024)], lanes, 16, graphs)  # warm-up: code paths, allocator
    per_round = []
    for _ in range(rounds):
        steps = decode_side_by_side(model, prompt, lanes, new_tokens, graphs)
        summary = {spec: summarise(s) for spec, s in steps.items()}
        for res in summary.values():
            res["tpot_vs_baseline"] = res["tpot"] / summary[baseline]["tpot"]
        per_round.append(summary)
    rows, stored = [], kv_dtypes(model, lanes, prompt.shape[1] + new_tokens)
    for spec, budget in lanes:
        runs = [r[spec] for r in per_round]
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        ratios = [r["tpot_vs_baseline"] for r in runs]
        rows.append({"method": spec, "budget": budget, "context": context, "new_tokens": new_tokens,
                     "rounds": rounds, "baseline": baseline, **row, "tpot_vs_baseline_min": min(ratios),
                     "tpot_vs_baseline_max": max(ratios), "kv_dtype": stored[spec], "graphs": graphs})
    return rows


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['model']} on {meta['cpu'] if meta['device'] == 'cpu' else meta['gpu']} ({meta['device']}, "
             f"{meta['threads']} threads), {meta['date']}, commit {meta['commit']}. Every method decoding in one "
             f"process, steps interleaved; medians over {rows[0]['rounds']} rounds of {rows[0]['new_tokens'] - 1} "
             f"steps; ratios to {rows[0]['baseline']} taken within each round (range in brackets)."
             + (" Decode steps replayed from CUDA graphs." if rows[0].get("graphs") else ""), "",
             f"| context | method | TPOT ms | plain step ms | routing event extra ms | TPOT × {rows[0]['baseline']} |",
             "|" + "---|" * 6]
    for r in rows:
        extra = f"{1000 * r['routing_extra']:.0f}" if "routing_extra" in r else "—"
        plain = f"{1000 * r['plain_step']:.1f}" if "plain_step" in r else "—"
        lines.append(f"| {r['context']} | {r['method']} | {1000 * r['tpot']:.1f} | {plain} | {extra} | "
                     f"{r['tpot_vs_baseline']:.3f} [{r['tpot_vs_baseline_min']:.3f}–{r['tpot_vs_baseline_max']:.3f}] |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tpot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fullkv,qevict")
    parser.add_argument("--baseline", default="fullkv", help="the method ratios are taken against (one of --methods)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--graphs", action="store_true",
                        help="replay decode steps from CUDA graphs (a GPU; every method must be able to)")
    parser.add_argument("--out", default=str(RESULTS / "tpot"))
    add_model_args(parser)
    args = parser.parse_args(argv)
    specs = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.baseline not in specs:
        raise ValueError(f"--baseline must be one of --methods {specs} (got {args.baseline!r})")
    if args.rounds < 1 or args.new_tokens < 2:
        raise ValueError(f"--rounds must be >= 1 and --new-tokens >= 2 (got {args.rounds}, {args.new_tokens})")
    lanes = method_lanes(specs, [args.budget])  # bad specs fail before anything runs, with the allowed values
    model, tokenizer, meta = load(args.model, args.device, args.threads)
    if args.graphs and meta["device"] == "cpu":
        raise ValueError("--graphs replays CUDA graphs: it needs --device cuda (this run is on cpu)")
    rows = []
    for context in tqdm([int(c) for c in args.contexts.split(",")], desc="tpot", unit="context"):
        rows += run(model, tokenizer, lanes, context, args.new_tokens, args.rounds, args.baseline, args.graphs)
    for row in rows:
        print(f"{row['context']:>6} {row['method']:18s} tpot={1000 * row['tpot']:.1f} ms "
              f"x{args.baseline}={row['tpot_vs_baseline']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tpot-{meta['device'].split(':')[0]}-{(args.model or 'smollm2').replace(':', '-')}"
    (out / f"{stem}.jsonl").write_text("".join(json.dumps({**r, **meta}) + "\n" for r in rows))
    (out / f"{stem}.md").write_text(table(rows, meta))
    print(f"wrote {out / (stem + '.md')}")


if __name__ == "__main__":
    main()
