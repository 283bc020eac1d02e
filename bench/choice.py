"""The choice of QEvict's default on development data (bench/choice.md), applied to the
committed rows: every candidate's retrieval R (5% and 10%, 2K and 4K), its 20% retrieval, its mean KL on the
development passages, the fidelity gate, and its paired difference from the reference on the same prompts.

    python -m bench.choice --reference qevict --folder bench/results/default_dev_16bit
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from statistics import mean

from .common import RESULTS, read_jsonl
from .stats import paired, paired_cell, pooled

RETRIEVAL_BUDGETS = (0.05, 0.1)


def scores(rows: list[dict]) -> dict[tuple[str, float], dict[tuple, float]]:
    """(lane, budget) -> {(length, task, sample): score}."""
    out: dict = defaultdict(dict)
    for r in rows:
        if r.get("score") is not None:
            out[(r["method"], r["budget"])][(r["length"], r["task"], r["sample"])] = r["score"]
    return out


def retrieval(budgets: tuple, by_budget: dict) -> float | None:
    """Mean over lengths of the mean score at ``budgets`` (each length weighs the same)."""
    per_length = defaultdict(list)
    for budget in budgets:
        for (length, _, _), score in by_budget.get(budget, {}).items():
            per_length[length].append(score)
    return 100 * mean(mean(v) for v in per_length.values()) if per_length else None


def kl_means(rows: list[dict]) -> dict[tuple[str, float], float]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["method"], r["budget"])].append(r["kl"])
    return {key: mean(v) for key, v in groups.items()}


def choose(ruler_rows: list[dict], fidelity_rows: list[dict], reference: str) -> list[dict]:
    """One dict per candidate, best R first; ``gate``: KL no higher than the reference's at every budget."""
    cells, kls = scores(ruler_rows), kl_means(fidelity_rows)
    lanes = sorted({m for m, b in cells if b is not None})
    budgets = sorted({b for _, b in cells if b is not None})
    out = []
    for lane in lanes:
        by_budget = {b: cells.get((lane, b), {}) for b in budgets}
        kl = {b: kls.get((lane, b)) for b in budgets}
        gate = all(kl[b] is not None and kls.get((reference, b)) is not None and kl[b] <= kls[(reference, b)]
                   for b in budgets)
        pooled_a, pooled_b = pooled([(by_budget.get(b, {}), cells.get((reference, b), {})) for b in RETRIEVAL_BUDGETS])
        out.append({"lane": lane, "R": retrieval(RETRIEVAL_BUDGETS, by_budget),
                    "R20": retrieval((0.2,), by_budget), "kl": kl, "gate": gate or lane == reference,
                    "vs_reference": paired([100 * x for x in pooled_a], [100 * x for x in pooled_b])
                    if pooled_a else None})
    return sorted(out, key=lambda c: (-(c["R"] or 0), -(c["R20"] or 0)))


def table(candidates: list[dict], reference: str) -> str:
    budgets = sorted(next(iter(candidates))["kl"]) if candidates else []
    head = (["candidate", "R: 5% and 10% (2K, 4K)", f"R − {reference} [95% CI]", "20%"]
            + [f"KL @{b:.0%}" for b in budgets] + ["KL gate"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in candidates:
        kl = [f"{c['kl'][b]:.4f}" if c["kl"][b] is not None else "—" for b in budgets]
        diff = paired_cell(c["vs_reference"], 1, 1, "higher") if c["lane"] != reference else "—"
        lines.append(f"| `{c['lane']}` | {c['R']:.1f} | {diff} | {c['R20']:.1f} | " + " | ".join(kl)
                     + f" | {'pass' if c['gate'] else 'fail'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.choice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=str(RESULTS / "default_dev_16bit"))
    parser.add_argument("--reference", default="qevict")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    ruler_rows = read_jsonl(sorted((folder / "ruler").glob("ruler-*.jsonl")))
    fidelity_path = folder / "fidelity" / "fidelity.jsonl"
    fidelity_rows = read_jsonl([fidelity_path]) if fidelity_path.exists() else []
    print(table(choose(ruler_rows, fidelity_rows, args.reference), args.reference))


if __name__ == "__main__":
    main()
