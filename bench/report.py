"""Tables and plots from benchmark JSONL: markdown tables, Pareto plots (PNG + interactive HTML), the FMM curve and
the tier-mass chart. ``python -m bench.report`` re-renders the table and Pareto plot of every RULER folder
(``ruler-*.jsonl``) and fidelity folder (``fidelity.jsonl``) under bench/results/, then every table marked in the docs (bench/markers.py);
the other benchmarks render their own tables when they run."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from .common import RESULTS, read_jsonl  # noqa: E402
from .compare import fidelity_paired, ruler_paired  # noqa: E402
from .markers import update_documents  # noqa: E402

COLORS = {"qevict": "#16a34a", "fullkv": "#111827", "snapkv": "#2563eb", "adakv": "#7c3aed", "streamingllm": "#6b7280",
          "defensivekv": "#db2777", "layer_defensivekv": "#be185d", "criticalkv": "#0891b2", "h2o": "#ea580c",
          "kivi2": "#ca8a04", "kivi4": "#a16207", "qevict_nopromo": "#65a30d", "r1": "#f97316", "r2": "#fb923c"}


def interval(values: list[float], digits: int = 3) -> str:
    """mean ± half-width of the 95% t-interval over independent runs (passages); the mean alone for one run."""
    from scipy.stats import t

    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "—"
    half = t.ppf(0.975, len(values) - 1) * stdev(values) / math.sqrt(len(values))  # Student t at every df
    return f"{mean(values):.{digits}f} ± {half:.{digits}f}"


def label(method: str, budget) -> str:
    return method if budget is None else f"{method} @{budget:.0%}"


def ruler_report(rows: list[dict], out: Path) -> Path:
    """ruler_table.md (and the Pareto plots) in ``out``."""
    text, points = ruler_text(rows)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "ruler_table.md"
    table.write_text(text)
    pareto(points, "RULER (default tasks): score vs measured KV memory", "score (×100)", out / "ruler_pareto")
    return table


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


def pareto(points: list[tuple], title: str, ylabel: str, stem: Path) -> None:
    """Score against measured KV ratio, one line per method across budgets (PNG and interactive HTML)."""
    by_method = defaultdict(list)
    for method, budget, ratio, score in points:
        if score is not None:
            by_method[method].append((ratio, score, budget))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    figure = go.Figure()
    for method, pts in sorted(by_method.items()):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        color = COLORS.get(method, "#444444")
        ax.plot(xs, ys, marker="o", label=method, color=color, linewidth=2.5 if method == "qevict" else 1.2)
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=method, line={"color": color},
                                    text=[f"budget {p[2]}" for p in pts]))
    ax.set_xscale("log")
    ax.set_xlabel("measured KV bytes / FullKV (log)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)
    figure.update_layout(title=title, xaxis={"title": "measured KV bytes / FullKV", "type": "log"},
                         yaxis={"title": ylabel}, template="plotly_white")
    # A fixed div id (plotly draws a random one) so that re-rendering unchanged results leaves the file unchanged.
    figure.write_html(stem.with_suffix(".html"), include_plotlyjs="cdn", div_id=stem.name)


def fidelity_report(rows: list[dict], out: Path) -> Path:
    """fidelity_table.md (and the Pareto plots) in ``out``."""
    text, points = fidelity_text(rows)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "fidelity_table.md"
    table.write_text(text)
    pareto(points, "Fidelity: top-1 agreement with FullKV vs measured KV memory", "top-1 agreement",
           out / "fidelity_pareto")
    return table


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    for folder in sorted(path for path in Path(args.results).iterdir() if path.is_dir()):
        if shards := sorted(folder.glob("ruler-*.jsonl")):
            print(ruler_report(read_jsonl(shards), folder))
        if (folder / "fidelity.jsonl").exists():
            print(fidelity_report(read_jsonl([folder / "fidelity.jsonl"]), folder))
    for path in update_documents():  # the tables between markers in README.md, bench/README.md and docs/
        print(path)


if __name__ == "__main__":
    main()
