"""Tables in the docs, written from committed JSONL between markers, never by hand.

A document holds ``<!-- bench.report KIND FOLDER -->`` ... ``<!-- /bench.report -->``; ``python -m bench.report``
replaces what lies between with the table of KIND rendered from the rows under ``bench/results/FOLDER``:
``ruler``, ``fidelity``, ``tpot``, ``speed``, ``studio_latency``, ``conditions``, ``choice``; ``versus=A,B`` /
``kl_versus=A,B``: method A minus method B in RULER score / fidelity KL, paired; ``headline=M``: M against FullKV
and the best baseline at each budget and length; ``drift`` / ``drift=A,B``: KL over a long decode and its slope,
paired against the best baseline, for every method or for A and B; ``vllm_needle`` / ``vllm_serve``: the vLLM
plugin's rows. ``tests/test_bench_docs.py`` fails when the committed text differs from a fresh render. FOLDER may
name several folders joined by ``+`` (their rows are read together).
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import RESULTS, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "bench/README.md", "bench/choice.md", "bench/ruler.md", "bench/fidelity.md",
             "docs/engine.md", "docs/baselines.md", "docs/library.md", "docs/studio.md", "docs/vllm.md")
MARKER = re.compile(r"(<!-- bench\.report ([\w=,]+) ([\w/+.-]+) -->\n)(.*?)(<!-- /bench\.report -->)", re.S)


def render(kind: str, folders: str, results: Path = RESULTS) -> str:
    from .choice import choose, table
    from .report import fidelity_text, ruler_text

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
    if kind in ("vllm_needle", "vllm_serve"):
        from .vllm_tables import needle_table, serve_table

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
    if kind == "speed":
        from .speed import speed_table

        rows = read_jsonl(sorted(f for p in paths for f in p.glob("speed-*.jsonl")))
        return speed_table(rows, rows[0])
    if kind == "conditions":
        import json

        from .conditions import table_text

        return table_text(json.loads((paths[0] / "diagnostics.json").read_text()))
    if kind == "choice":
        ruler = read_jsonl(sorted(f for p in paths for f in (p / "ruler").glob("ruler-*.jsonl")))
        fidelity = read_jsonl(sorted(f for p in paths for f in (p / "fidelity").glob("fidelity*.jsonl")))
        return table(choose(ruler, fidelity, "qevict"), "qevict")
    raise ValueError(f"unknown table kind {kind!r}; kinds: ruler, fidelity, tpot, speed, studio_latency, conditions, "
                     "choice, versus=A,B, kl_versus=A,B, headline=M, vllm_needle, vllm_serve, drift, drift=A,B")


def footing(folders: str, results: Path = RESULTS) -> str:
    """One line under a table: what its caches were stored in and whether its rows came from committed code, read
    from the rows themselves (every JSONL under the folders)."""
    rows = read_jsonl(sorted(f for name in folders.split("+") for f in (results / name).rglob("*.jsonl")))
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
    line = f"*Caches stored in {' and '.join(words)}. Rows: {len(rows)}"
    line += f" at commit{'s' if len(commits) > 1 else ''} {', '.join(commits[:4])}{' …' if len(commits) > 4 else ''}"
    line += f", {dirty} from a tree with uncommitted changes.*" if dirty else ".*"
    return line


def rendered(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked table rendered afresh, each with its footing line."""
    def table(m) -> str:
        body = render(m.group(2), m.group(3), results).rstrip("\n")
        line = footing(m.group(3), results) if m.group(2) != "conditions" else ""
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
