"""Attention drift over a long decode: does a method's divergence from FullKV grow with the decode position?

    python -m bench.drift --methods streamingllm,snapkv,adakv,kivi2,qevict --budgets 0.05,0.1,0.2 \\
        --prefill 1024 --steps 1024 --passages 3 --out bench/results/drift

Each passage (a stretch of the committed public-domain Austen text, ``--spacing`` sentences apart) is prefilled,
then its next ``steps`` tokens are fed one at a time through every cache, teacher-forced, as ``bench.fidelity``
does (all lanes are rows of one batched forward; row 0 is FullKV). Per step: KL(FullKV || method) of the next-token
distributions and top-1 agreement; both are averaged in bins of ``--bin`` decode positions. The table gives each
method's KL per bin (mean over passages), its growth (KL of the last quarter of the decode over the first) and the
least-squares slope of KL against position, per 1K tokens, with a 95% interval over passages. The claim under test:
QEvict's divergence grows more slowly than the baselines'. Passages already in the JSONL are skipped (resumable).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tqdm import tqdm  # noqa: E402

from .common import RESULTS, add_model_args, append_jsonl, method_lanes, read_jsonl, setup  # noqa: E402
from .fidelity import measure, passage_tokens  # noqa: E402
from .compare import interval, label  # noqa: E402
from .report import COLORS  # noqa: E402

def binned(values: list[float], width: int) -> list[float]:
    return [mean(values[i:i + width]) for i in range(0, len(values), width)]


def slope_per_1k(values: list[float]) -> float:
    """Least-squares slope of per-step values against decode position, per 1,000 positions."""
    n = len(values)
    xs = range(n)
    x_mean, y_mean = (n - 1) / 2, mean(values)
    denominator = sum((x - x_mean) ** 2 for x in xs)
    return 1000 * sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, values)) / denominator if denominator else 0.0


def summarise(row: dict, width: int) -> dict:
    """A JSONL row: the per-step curves reduced to bins, growth and slope."""
    kl, top1 = row.pop("kl_steps"), row.pop("top1_steps")
    quarter = max(1, len(kl) // 4)
    first, last = mean(kl[:quarter]), mean(kl[-quarter:])
    return {**row, "bin": width, "kl_bins": binned(kl, width), "top1_bins": binned(top1, width),
            "kl_growth": last / first if first > 0 else None, "kl_slope_per_1k": slope_per_1k(kl)}


def report(rows: list[dict], out: Path) -> Path:
    lanes = sorted({(r["method"], r["budget"]) for r in rows}, key=lambda m: (m[1] or 2, m[0]))
    width = rows[0]["bin"]
    bins = min(len(r["kl_bins"]) for r in rows)
    header = (["method", "KV ratio", "passages"] + [f"KL {i * width}–{(i + 1) * width}" for i in range(bins)]
              + ["top-1 first bin", "top-1 last bin", "KL growth (last/first quarter)", "KL slope per 1K (95% CI)"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, budget in lanes:
        group = [r for r in rows if (r["method"], r["budget"]) == (method, budget)]
        kl = [mean(r["kl_bins"][i] for r in group) for i in range(bins)]
        growth = [r["kl_growth"] for r in group if r["kl_growth"] is not None]
        lines.append("| " + " | ".join(
            [label(method, budget), f"{mean(r['kv_ratio'] for r in group):.3f}", str(len(group))]
            + [f"{v:.3f}" for v in kl]
            + [f"{mean(r['top1_bins'][0] for r in group):.3f}", f"{mean(r['top1_bins'][bins - 1] for r in group):.3f}",
               f"{mean(growth):.2f}" if growth else "—", interval([r["kl_slope_per_1k"] for r in group])]) + " |")
    out.mkdir(parents=True, exist_ok=True)
    table = out / "drift_table.md"
    table.write_text(f"KL(FullKV ‖ method) of the next-token distributions, teacher-forced, mean over passages in "
                     f"bins of {width} decode positions; top-1: agreement with FullKV's argmax; slope: least squares "
                     f"of per-step KL against position, mean ± 95% t-interval over passages.\n\n"
                     + "\n".join(lines) + "\n")
    budgets = sorted({b for _, b in lanes if b is not None})
    fig, axes = plt.subplots(2, max(1, len(budgets)), figsize=(4.2 * max(1, len(budgets)), 6.4), squeeze=False,
                             sharex=True)
    centres = [(i + 0.5) * width for i in range(bins)]
    for col, budget in enumerate(budgets):
        for method, b in lanes:
            if b not in (budget, None):
                continue
            group = [r for r in rows if (r["method"], r["budget"]) == (method, b)]
            style = {"color": COLORS.get(method), "label": method, "linewidth": 2.2 if "qevict" in method else 1.2}
            axes[0][col].plot(centres, [mean(r["kl_bins"][i] for r in group) for i in range(bins)], **style)
            axes[1][col].plot(centres, [mean(r["top1_bins"][i] for r in group) for i in range(bins)], **style)
        axes[0][col].set_title(f"budget {budget:.0%}")
        axes[1][col].set_xlabel("decode position")
    axes[0][0].set_ylabel("KL(FullKV ‖ method)")
    axes[1][0].set_ylabel("top-1 agreement")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)  # one colour per method in every panel
    fig.tight_layout()
    fig.savefig(out / "drift.png", dpi=120)
    plt.close(fig)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.drift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="streamingllm,snapkv,adakv,kivi2,qevict")
    parser.add_argument("--budgets", default="0.05,0.1,0.2")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--passages", type=int, default=3)
    parser.add_argument("--offset", type=int, default=0, help="first sentence of the first passage")
    parser.add_argument("--spacing", type=int, default=700, help="sentences between the starts of two passages")
    parser.add_argument("--bin", type=int, default=128, help="decode positions per bin")
    parser.add_argument("--out", default=str(RESULTS / "drift"))
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.steps < 4 or args.bin < 1:
        raise ValueError(f"--steps must be >= 4 and --bin >= 1 (got {args.steps}, {args.bin})")
    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    lanes = method_lanes([m.strip() for m in args.methods.split(",") if m.strip()],
                         [float(b) for b in args.budgets.split(",")])
    out = Path(args.out)
    path = out / "drift.jsonl"
    # Resumable: a passage (by its offset) already in the file is not run again.
    done = {r["offset"] for r in read_jsonl([path])} if path.exists() else set()
    offsets = [args.offset + i * args.spacing for i in range(args.passages)]
    todo = passage_tokens(tokenizer, args.prefill + args.steps, [o for o in offsets if o not in done],
                          args.model == "tiny")
    device = next(model.parameters()).device
    for offset, tokens in tqdm(todo.items(), desc="drift", unit="passage"):
        for row in measure(model, tokens.to(device), args.prefill, lanes, curves=True):
            append_jsonl(path, {**summarise(row, args.bin), "passage": offsets.index(offset), "offset": offset,
                                **meta})
    print(f"wrote {report(read_jsonl([path]), out)}")


if __name__ == "__main__":
    main()
