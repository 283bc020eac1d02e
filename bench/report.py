"""Every table in the docs, rendered from committed JSONL, and the Pareto plots.

A document holds ``<!-- bench.report KIND FOLDER -->`` ... ``<!-- /bench.report -->``; ``python -m bench.report``
replaces what lies between with the table of KIND rendered from the rows under ``bench/results/FOLDER``, each with a
footing line read from the rows (what the caches were stored in, the commits, rows from a dirty tree), and redraws
the Pareto plots (PNG + interactive HTML) of every RULER (``ruler-*.jsonl``) and fidelity folder. Kinds: ``ruler``,
``fidelity``, ``tpot``, ``speed``, ``studio_latency``, ``studio_lanes`` (the studio's "Time the lanes alone",
bench/studio_latency.py), ``conditions``, ``choice``, ``claims`` (the paper's claims beside ours, bench/claims.py);
``versus=A,B`` / ``kl_versus=A,B``: method A minus method B in RULER score / fidelity
KL, paired; ``headline=M``: M against FullKV and the best baseline at each budget and length; ``drift`` /
``drift=A,B``: KL over a long decode and its slope, paired against the best baseline, for every method or for A and
B; ``vllm_needle`` / ``vllm_serve`` / ``vllm_served``: the vLLM plugin's rows; ``resources``: the fused kernels'
registers, spills and shared memory (bench/kernel_resources.py); ``launches``: the kernels a decode step launches on
the GPU's paths (bench/launches.py); ``kvpress``: the baselines beside kvpress's presses (bench/kvpress_check.py).
``tests/test_bench_docs.py`` fails when the committed text differs from a fresh render. FOLDER may name several
folders joined by ``+`` (their rows are read together)."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from .common import RESULTS, read_jsonl  # noqa: E402
from .compare import fidelity_text, ruler_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "bench/README.md", "bench/choice.md", "bench/ruler.md", "bench/fidelity.md", "bench/gpu.md",
             "bench/evaluation.md", "bench/promotion.md", "docs/engine.md", "docs/baselines.md", "docs/library.md",
             "docs/studio.md", "docs/vllm.md")
MARKER = re.compile(r"(<!-- bench\.report ([\w=,+]+) ([\w/+.-]+) -->\n)(.*?)(<!-- /bench\.report -->)", re.S)
COLORS = {"qevict": "#16a34a", "fullkv": "#111827", "snapkv": "#2563eb", "adakv": "#7c3aed", "streamingllm": "#6b7280",
          "defensivekv": "#db2777", "layer_defensivekv": "#be185d", "criticalkv": "#0891b2", "h2o": "#ea580c",
          "kivi2": "#ca8a04", "kivi4": "#a16207", "qevict_nopromo": "#65a30d", "r1": "#f97316", "r2": "#fb923c"}


def render(kind: str, folders: str, results: Path = RESULTS) -> str:
    from .choice import choose, table

    paths = [results / f for f in folders.split("+")]
    missing = [str(p) for p in paths if not p.is_dir()]
    if missing:
        raise ValueError(f"no results folder {missing} for a {kind} table")
    if kind.startswith("versus="):  # versus=A,B: A minus B, paired
        from .compare import ruler_versus

        a, b = kind.split("=", 1)[1].split(",")
        return ruler_versus(read_jsonl(sorted(f for p in paths for f in p.glob("ruler-*.jsonl"))), a, b)
    if kind.startswith("headline="):  # headline=M: M's score, minus FullKV and minus the best baseline, per cell
        from .compare import ruler_headline

        return ruler_headline(read_jsonl(sorted(f for p in paths for f in p.glob("ruler-*.jsonl"))),
                              kind.split("=", 1)[1])
    if kind.startswith("kl_versus="):  # kl_versus=A,B: A's fidelity minus B's, paired over passages
        from .compare import fidelity_versus

        a, b = kind.split("=", 1)[1].split(",")
        return fidelity_versus(read_jsonl(sorted(f for p in paths for f in p.glob("fidelity*.jsonl"))), a, b)
    if kind == "vllm_served":
        from .vllm_served import table as served_table

        return served_table(read_jsonl(sorted(f for p in paths for f in p.glob("served.jsonl"))))
    if kind in ("vllm_needle", "vllm_serve"):
        from .vllm_plugin import needle_table, serve_table

        name, table_of = {"vllm_needle": ("needle.jsonl", needle_table), "vllm_serve": ("serve.jsonl", serve_table)}[kind]
        return table_of(read_jsonl(sorted(f for p in paths for f in p.glob(name))))
    if kind == "drift" or kind.startswith("drift="):
        from .compare import drift_paired

        only = tuple(kind.split("=", 1)[1].split(",")) if "=" in kind else ()
        return drift_paired(read_jsonl(sorted(f for p in paths for f in p.glob("drift.jsonl"))), only)
    if kind == "ruler":
        return ruler_text(read_jsonl(sorted(f for p in paths for f in p.glob("ruler-*.jsonl"))))[0]
    if kind == "fidelity":
        return fidelity_text(read_jsonl(sorted(f for p in paths for f in p.glob("fidelity*.jsonl"))))[0]
    if kind == "tpot":
        from .tpot import table as tpot_table

        rows = read_jsonl(sorted(f for p in paths for f in p.glob("tpot-*.jsonl")))
        return tpot_table(rows, rows[0])
    if kind == "studio_latency":
        from .studio_latency import table as latency_table

        return latency_table(read_jsonl(sorted(f for p in paths for f in p.glob("studio_latency.jsonl"))))
    if kind == "studio_lanes":
        from .studio_latency import lanes_table

        return lanes_table(read_jsonl(sorted(f for p in paths for f in p.glob("studio_lanes.jsonl"))))
    if kind == "speed":
        from .speed import speed_table

        rows = read_jsonl(sorted(f for p in paths for f in p.glob("speed-*.jsonl")))
        return speed_table(rows, rows[0])
    if kind == "conditions":
        import json

        from .conditions import table_text

        return table_text(json.loads((paths[0] / "diagnostics.json").read_text()))
    if kind == "resources":
        from .kernel_resources import table as resources_table

        return resources_table(read_jsonl(sorted(f for p in paths for f in p.glob("*.jsonl"))))
    if kind == "launches":
        from .launches import table as launches_table

        return launches_table(read_jsonl(sorted(f for p in paths for f in p.glob("launches.jsonl"))))
    if kind == "kvpress":
        from .kvpress_check import table as kvpress_table

        return kvpress_table(read_jsonl(sorted(f for p in paths for f in p.glob("kvpress.jsonl"))))
    if kind == "claims":
        from .claims import table as claims_table

        return claims_table(paths)
    if kind == "choice":
        ruler = read_jsonl(sorted(f for p in paths for f in (p / "ruler").glob("ruler-*.jsonl")))
        fidelity = read_jsonl(sorted(f for p in paths for f in (p / "fidelity").glob("fidelity*.jsonl")))
        return table(choose(ruler, fidelity, "qevict"), "qevict")
    raise ValueError(f"unknown table kind {kind!r}; kinds: ruler, fidelity, tpot, speed, studio_latency, conditions, "
                     "choice, claims, resources, launches, studio_lanes, kvpress, versus=A,B, kl_versus=A,B, "
                     "headline=M, vllm_needle, vllm_serve, vllm_served, drift, drift=A,B")


def footing(folders: str, results: Path = RESULTS, caches: bool = True) -> str:
    """One line under a table: what its caches were stored in (rows of runs with caches) and whether its rows came
    from committed code, read from the rows themselves (every JSONL under the folders, and bench.conditions'
    diagnostics.json, one row per condition)."""
    rows = read_jsonl(sorted(f for name in folders.split("+") for f in (results / name).rglob("*.jsonl")))
    rows += [row for name in folders.split("+") for f in sorted((results / name).rglob("diagnostics.json"))
             for row in _diagnostics_rows(f)]
    if not rows:
        return ""
    stored = sorted({r.get("kv_dtype") or "" for r in rows})
    words = []
    for dtype in stored:
        if dtype:
            words.append(f"{dtype} (`kv_dtype`)")
        elif all(str(r.get("device", "cpu")).startswith("cpu") for r in rows if not r.get("kv_dtype")):
            words.append("float32, the model's dtype on this CPU (rows from before 16-bit caches: their budgets are "
                         "shares of a float32 cache, which counts a low-bit window at half the share it has in 16 bits)")
        else:
            words.append("the model's dtype (rows from before 16-bit caches)")
    dirty = sum(bool(r.get("dirty")) for r in rows)
    commits = sorted({r["commit"] for r in rows if r.get("commit")})
    line = f"*Caches stored in {' and '.join(words)}. Rows: {len(rows)}" if caches else f"*Rows: {len(rows)}"
    line += f" at commit{'s' if len(commits) > 1 else ''} {', '.join(commits[:4])}{' …' if len(commits) > 4 else ''}"
    line += f", {dirty} from a tree with uncommitted changes.*" if dirty else ".*"
    return line


def _diagnostics_rows(path: Path) -> list[dict]:
    """bench.conditions' one JSON file as footing rows: one per condition, with the run's commit and tree."""
    import json

    run = json.loads(path.read_text())
    return [{**run["meta"], "kv_dtype": c.get("kv_dtype")} for c in run["conditions"].values()]


def rendered(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked table rendered afresh, each with its footing line."""
    def table(m) -> str:
        body = render(m.group(2), m.group(3), results).rstrip("\n")
        kind = m.group(2)
        # rows without a cache of QEvict's (kernels compiled; a vLLM server's own KV, said in its table's header)
        line = footing(m.group(3), results, caches=kind not in ("resources", "vllm_served"))
        return m.group(1) + body + ("\n\n" + line if line else "") + "\n" + m.group(5)
    return MARKER.sub(table, text)


def update_documents(root: Path = ROOT, results: Path = RESULTS) -> list[Path]:
    """Rewrite the marked tables of every document; -> the documents that changed."""
    changed = []
    for name in DOCUMENTS:
        path = root / name
        if path.exists():
            text = path.read_text()
            fresh = rendered(text, results)
            if fresh != text:
                path.write_text(fresh)
                changed.append(path)
    return changed


def ruler_report(rows: list[dict], out: Path) -> Path:
    """ruler_table.md (and the Pareto plots) in ``out``."""
    text, points = ruler_text(rows)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "ruler_table.md"
    table.write_text(text)
    pareto(points, "RULER (default tasks): score vs measured KV memory", "score (×100)", out / "ruler_pareto")
    return table


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
