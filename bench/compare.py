"""The rendered tables of RULER and fidelity rows (means per cell, intervals over passages) and their paired
comparisons: each method against FullKV and against the best baseline at the same
budget, over the samples (RULER: task and sample; fidelity: passage) both ran, with a 95% bootstrap interval
(bench.stats). A difference is called better or worse only where its interval excludes zero."""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean, stdev

from qevict_core.registry import METHODS

from .stats import MARGINS, paired, paired_cell, pooled, shared

# The paper's baselines that take a budget: the "best baseline" of a budget is the one of these with the best mean.
BUDGETED_BASELINES = tuple(name for name, spec in METHODS.items() if spec.family == "eviction" and spec.kind == "method")


def by_sample(rows: list[dict], key, value) -> dict:
    """{(method, budget, *key(r)[:-1]): {key(r)[-1]: value(r)}} over the rows with a value: each method's
    values by the item they pair on (a prompt, a passage), grouped by the rest of ``key``."""
    out = defaultdict(dict)
    for r in rows:
        if value(r) is not None:
            out[(r["method"], r["budget"]) + key(r)[:-1]][key(r)[-1]] = value(r)
    return out


def ruler_paired(rows: list[dict]) -> str:
    """Per length: every method at every budget minus FullKV and minus the best budgeted baseline at that budget,
    string_match_all × 100 paired over (task, sample)."""
    samples = by_sample(rows, lambda r: (r["length"], (r["task"], r["sample"])), lambda r: r.get("score"))
    lengths = sorted({r["length"] for r in rows})
    lanes = sorted({(r["method"], r["budget"]) for r in rows if r["method"] != "fullkv"},
                   key=lambda m: (m[1] or 2, m[0]))
    header = ["method"] + [f"{what} {n // 1024}K" for n in lengths for what in ("− FullKV", "− best baseline")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, budget in lanes:
        cells = []
        for length in lengths:
            mine = samples.get((method, budget, length), {})
            full = samples.get(("fullkv", None, length), {})
            cells.append(paired_cell(paired(*shared(mine, full)) if set(mine) & set(full) else None, 100, 1, "higher"))
            best = _best(samples, budget, length, exclude=method)
            if best is None:
                cells.append("—")
                continue
            theirs = samples[(best, budget, length)]
            result = paired(*shared(mine, theirs)) if set(mine) & set(theirs) else None
            cells.append(f"{paired_cell(result, 100, 1, 'higher')} vs {best}")
        name = method if budget is None else f"{method} @{budget:.0%}"
        lines.append("| " + " | ".join([name] + cells) + " |")
    return ("Paired differences in string_match_all × 100: mean [95% bootstrap CI] (shared samples; verdict; the "
            "smallest difference detectable with 80% power; exact sign test). "
            "The best baseline of a budget is the budgeted paper baseline with the highest mean there.\n\n"
            + "\n".join(lines) + "\n")


def fidelity_paired(rows: list[dict]) -> str:
    """Mean KL(FullKV ‖ method) minus the best budgeted baseline's at the same budget, paired over passages (lower
    is better)."""
    passages = by_sample(rows, lambda r: (r.get("offset", r.get("passage", 0)),), lambda r: r.get("kl"))
    lanes = sorted({(m, b) for (m, b) in passages if m != "fullkv"}, key=lambda m: (m[1] or 2, m[0]))
    lines = ["| method | KL − best baseline |", "|---|---|"]
    if not any(m in BUDGETED_BASELINES for m, _ in passages):
        return ""  # no baseline ran on these passages: nothing to pair with
    for method, budget in lanes:
        best = _best(passages, budget, None, exclude=method, higher=False)
        if best is None:
            lines.append(f"| {method if budget is None else f'{method} @{budget:.0%}'} | — |")
            continue
        mine, theirs = passages[(method, budget)], passages[(best, budget)]
        result = paired(*shared(mine, theirs)) if set(mine) & set(theirs) else None
        lines.append(f"| {method if budget is None else f'{method} @{budget:.0%}'} | "
                     f"{paired_cell(result, 1, 4, 'lower')} vs {best} |")
    return ("Paired differences in mean next-token KL: mean [95% bootstrap CI] (shared passages; verdict, lower is "
            "better; the smallest difference detectable with 80% power; exact sign test).\n\n" + "\n".join(lines)
            + "\n")


def _best(samples: dict, budget, length, exclude: str, higher: bool = True) -> str | None:
    """The budgeted baseline with the best mean at ``budget`` (and ``length``), other than ``exclude``."""
    if budget is None:
        return None
    tail = () if length is None else (length,)
    means = {m: mean(samples[(m, budget) + tail].values()) for m in BUDGETED_BASELINES
             if m != exclude and samples.get((m, budget) + tail)}
    if not means:
        return None
    return (max if higher else min)(means, key=means.get)


def ruler_versus(rows: list[dict], a: str, b: str) -> str:
    """``a`` minus ``b`` at each budget and length, and over the 5% and 10% budgets (one pair per prompt, its mean
    over the two), string_match_all × 100 paired over (task, sample)."""
    samples = by_sample(rows, lambda r: (r["length"], (r["task"], r["sample"])), lambda r: r.get("score"))
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["method"] == a and r["budget"] is not None})
    lines = ["| budget | " + " | ".join(f"{a} − {b} {n // 1024}K" for n in lengths) + " |",
             "|" + "---|" * (len(lengths) + 1)]
    for budget in budgets:
        cells = []
        for length in lengths:
            x, y = shared(samples.get((a, budget, length), {}), samples.get((b, budget, length), {}))
            cells.append(paired_cell(paired(x, y), 100, 1, "higher") if x else "—")
        lines.append(f"| {budget:.0%} | " + " | ".join(cells) + " |")
    # one pair per prompt of any length (its mean over the two budgets)
    prompts = by_sample(rows, lambda r: ((r["length"], r["task"], r["sample"]),), lambda r: r.get("score"))
    pooled_a, pooled_b = pooled([(prompts.get((a, x), {}), prompts.get((b, x), {})) for x in (0.05, 0.1)])
    if pooled_a:
        lines.append(f"| 5% and 10%, every length | {paired_cell(paired(pooled_a, pooled_b), 100, 1, 'higher')} |"
                     + " |" * (len(lengths) - 1))
    return "\n".join(lines) + "\n"


def ruler_headline(rows: list[dict], method: str) -> str:
    """The headline of ``method``: at each budget and length its mean score, and its paired difference with FullKV
    and with the best budgeted baseline there, string_match_all × 100 over (task, sample). Against FullKV, where
    every row of the cell ran after the RULER margin was set, the non-inferiority verdict too (bench.stats)."""
    samples = by_sample(rows, lambda r: (r["length"], (r["task"], r["sample"])), lambda r: r.get("score"))
    margin = MARGINS["ruler"]
    cell_rows = defaultdict(list)
    for r in rows:
        cell_rows[(r["method"], r["budget"], r["length"])].append(r)
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["method"] == method and r["budget"] is not None})
    lines = ["| budget | length | " + method + " | FullKV | − FullKV | best baseline | − best baseline |",
             "|---|---|---|---|---|---|---|"]
    judged_any = False
    for budget in budgets:
        for length in lengths:
            mine = samples.get((method, budget, length), {})
            full = samples.get(("fullkv", None, length), {})
            best = _best(samples, budget, length, exclude=method)
            if not mine or not full or best is None:
                continue
            theirs = samples[(best, budget, length)]
            vs_full = paired(*shared(mine, full)) if set(mine) & set(full) else None
            vs_best = paired(*shared(mine, theirs)) if set(mine) & set(theirs) else None
            judged = margin.judges(cell_rows[(method, budget, length)] + cell_rows[("fullkv", None, length)])
            judged_any |= judged
            lines.append(f"| {budget:.0%} | {length // 1024}K | {100 * mean(mine.values()):.1f} | "
                         f"{100 * mean(full.values()):.1f} | "
                         f"{paired_cell(vs_full, 100, 1, 'higher', margin.size if judged else None)} | "
                         f"{best} {100 * mean(theirs.values()):.1f} | {paired_cell(vs_best, 100, 1, 'higher')} |")
    note = (f"\n\"No worse\" than FullKV: against a margin of {margin.size:g} points set at {margin.set_at[:10]}, on the "
            "cells whose rows all ran after it (non-inferiority: the one-sided 95% bound above −margin; equivalence: "
            "both 90% bounds within ±margin); an earlier cell is not judged: its margin would come after its rows.\n")
    return "\n".join(lines) + "\n" + (note if judged_any else "")


def fidelity_versus(rows: list[dict], a: str, b: str) -> str:
    """Mean next-token KL of ``a`` minus ``b`` at each budget, paired over passages (lower is better)."""
    passages = by_sample(rows, lambda r: (r.get("offset", r.get("passage", 0)),), lambda r: r.get("kl"))
    budgets = sorted({budget for (m, budget) in passages if m == a and budget is not None})
    lines = [f"| budget | KL {a} | KL {b} | {a} − {b} |", "|---|---|---|---|"]
    for budget in budgets:
        x, y = shared(passages.get((a, budget), {}), passages.get((b, budget), {}))
        if x:
            lines.append(f"| {budget:.0%} | {mean(x):.4f} | {mean(y):.4f} | {paired_cell(paired(x, y), 1, 4, 'lower')} |")
    return "\n".join(lines) + "\n"


def drift_paired(rows: list[dict], only: tuple[str, ...] = ()) -> str:
    """Per lane (of the methods in ``only``, or every method): mean KL over the whole decode and the KL slope per 1K positions, each minus the best budgeted
    baseline's (the one with the lowest mean KL at that budget), paired over passages (lower is better)."""
    key = lambda r: (r["offset"],)  # noqa: E731 - a passage is its sentence offset
    kl = by_sample(rows, key, lambda r: r.get("kl"))
    slope = by_sample(rows, key, lambda r: r.get("kl_slope_per_1k"))
    ratio = by_sample(rows, key, lambda r: r.get("kv_ratio"))
    lanes = sorted({(m, b) for (m, b) in kl if m != "fullkv" and (not only or m in only)},
                   key=lambda m: (m[1] or 2, m[0]))
    lines = ["| method | KV ratio | passages | mean KL | KL slope per 1K | mean KL − best baseline | slope − best baseline |",
             "|---|---|---|---|---|---|---|"]
    for method, budget in lanes:
        mine = kl[(method, budget)]
        cells = [f"{mean(ratio[(method, budget)].values()):.3f}", str(len(mine)), f"{mean(mine.values()):.4f}", f"{mean(slope[(method, budget)].values()):+.4f}"]
        best = _best(kl, budget, None, exclude=method, higher=False)
        for table in (kl, slope):
            if best is None:
                cells.append("—")
                continue
            result = paired(*shared(table[(method, budget)], table[(best, budget)]))
            cells.append(f"{paired_cell(result, 1, 4, 'lower')} vs {best}")
        name = method if budget is None else f"{method} @{budget:.0%}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return ("KL(FullKV ‖ method) of the next-token distributions over the decode, teacher-forced; slope: least "
            "squares of per-step KL against decode position, per 1,000 positions. Paired differences: mean [95% "
            "bootstrap CI] (shared passages; verdict, lower is better). The best baseline of a budget is the "
            "budgeted paper baseline with the lowest mean KL there; the quantization baselines run at their own operating "
            "points, with no budget.\n\n" + "\n".join(lines) + "\n")


def interval(values: list[float], digits: int = 3) -> str:
    """mean ± half-width of the 95% t-interval over independent runs (passages); the mean alone for one run."""
    from scipy.stats import t

    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "—"
    half = t.ppf(0.975, len(values) - 1) * stdev(values) / math.sqrt(len(values))  # Student t at every df
    return f"{mean(values):.{digits}f} ± {half:.{digits}f}"


def label(method: str, budget) -> str:
    return method if budget is None else f"{method} @{budget:.0%}"


def ruler_text(rows: list[dict]) -> tuple[str, list[tuple]]:
    """The RULER table (scores per task and length) and its paired comparisons, and the Pareto points."""
    cells = defaultdict(list)
    for r in rows:
        cells[(r["method"], r["budget"], r["task"], r["length"])].append(r)
    columns = sorted({(r["task"], r["length"]) for r in rows}, key=lambda c: (c[1], c[0]))
    lanes = sorted({(r["method"], r["budget"]) for r in rows}, key=lambda m: (m[1] or 2, m[0]))
    lengths = sorted({n for _, n in columns})
    header = (["method", "KV ratio (measured)", "K_f / K_q"] + [f"{t} {n // 1024}K" for t, n in columns]
              + [f"avg {n // 1024}K (samples)" for n in lengths] + ["errors"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    points = []
    for method, budget in lanes:
        scores, ratios, errors = [], [], 0
        for task, length in columns:
            group = cells.get((method, budget, task, length), [])
            scored = [r["score"] for r in group if r.get("score") is not None]  # errors are not zeros
            errors += len(group) - len(scored)
            scores.append(100 * mean(scored) if scored else None)
            ratios += [r["kv_ratio"] for r in group]
        # Per length, every sample counts once: the tasks have equal sample counts in a finished sweep.
        per_length = [[r["score"] for (t, n) in columns if n == length
                       for r in cells.get((method, budget, t, n), []) if r.get("score") is not None]
                      for length in lengths]
        averages = [100 * mean(s) if s else None for s in per_length]
        ratio = mean(ratios) if ratios else float("nan")
        valid = [a for a in averages if a is not None]
        points.append((method, budget, ratio, mean(valid) if valid else None))
        lines.append("| " + " | ".join([label(method, budget), f"{ratio:.3f}", capacities(cells, method, budget)]
                                       + [f"{s:.1f}" if s is not None else "—" for s in scores]
                                       + [f"{a:.1f} ({len(s)})" if a is not None else "—"
                                          for a, s in zip(averages, per_length)] + [str(errors)]) + " |")
    return ("Scores: string_match_all × 100, mean over samples; KV ratio: measured bytes / FullKV bytes at "
                     "the end of generation; avg: mean over every sample of that length (sample count in brackets); "
                     "errors: samples whose generation raised, left out of every score; K_f / K_q: tier capacities per layer "
            "(QEvict family, rows that recorded them).\n\n" + "\n".join(lines) + "\n\n" + ruler_paired(rows)), points


def capacities(cells: dict, method: str, budget) -> str:
    """QEvict-family rows: the tier capacities (windows per layer) their plans gave, a range over prompt lengths."""
    rows = [r for (m, b, *_), group in cells.items() if (m, b) == (method, budget) for r in group
            if r.get("k_full") is not None]
    if not rows:
        return "—"
    def span(key):
        low, high = min(r[key] for r in rows), max(r[key] for r in rows)
        return str(low) if low == high else f"{low}–{high}"
    return f"{span('k_full')} / {span('k_quant')}"


def fidelity_text(rows: list[dict]) -> tuple[str, list[tuple]]:
    """Means over passages with 95% t-intervals (rows without a passage index count as one passage), and paired
    differences against the best baseline."""
    header = ["method", "KV ratio", "K_f / K_q", "passages", "mean KL(FullKV‖method)", "top-1 agreement",
              "perplexity", "FullKV perplexity"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["method"], r["budget"])].append(r)
    points = []
    for (method, budget), group in sorted(groups.items(), key=lambda g: (g[0][1] or 2, g[0][0])):
        ratio, top1 = mean(r["kv_ratio"] for r in group), mean(r["top1"] for r in group)
        lines.append(f"| {label(method, budget)} | {ratio:.3f} | {capacities(groups, method, budget)} | "
                     f"{len(group)} | "
                     f"{interval([r['kl'] for r in group], 4)} | {interval([r['top1'] for r in group])} | "
                     f"{interval([r['ppl'] for r in group], 2)} | {mean(r['ppl_fullkv'] for r in group):.2f} |")
        points.append((method, budget, ratio, top1))
    return ("Mean over passages ± half-width of the 95% t-interval; K_f / K_q: tier capacities per layer "
            "(QEvict family, rows that recorded them).\n\n" + "\n".join(lines) + "\n\n" + fidelity_paired(rows)), points
