"""Attention-drift diagnostics for the paper's R0-R4 conditions (Appendix I.1).

    python -m bench.conditions --prefill 512 --generate 256 --budget 0.2 --articles 2 --out bench/results/diagnostics

R0 is FullKV: it generates the tokens and, run again with eager attention, gives the reference traces. R1 (token
eviction, Ω=1), R2 (two-tier windows, Ω=8), R3 (three-tier, Ω=8) and R4 (three-tier, Ω=32) are replayed
teacher-forced over the same tokens, recording their routing events; qevict_core.diagnostics scores them.
R1-R4 take the paper's preset (prefill scores by Eq. 1 over every prompt query, so the policy's and FullKV's
scores are the same sum); "QEvict default" is ``QEvictConfig()`` (INT4 with float16 pairs, coverage first, forward
pooling, the last 32 prompt queries) and "R3 no promotion" the Appendix K ablation at R3's tier capacities.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import plotly.graph_objects as go  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from qevict_core import QEvictConfig, make_cache  # noqa: E402
from qevict_core import diagnostics as dg  # noqa: E402
from qevict_core.generation.model_call import cache_keyword, call  # noqa: E402

from .common import RESULTS, add_model_args, kv_dtype, setup  # noqa: E402
from .ruler_tasks import essay_sentences  # noqa: E402

# name -> (method, config fields over the paper's preset; None: QEvict's own default config)
CONDITIONS = {"R1": ("r1", {}), "R2": ("r2", {}), "R3": ("qevict", {}), "R4": ("qevict", {"omega": 32}),
              "QEvict default": ("qevict", None), "R3 no promotion": ("qevict_nopromo", {})}


def article(tokenizer, index: int, tokens: int) -> torch.Tensor:
    sentences = essay_sentences("austen")
    start = (index * 997) % max(1, len(sentences) - 400)
    ids = tokenizer(" ".join(sentences[start:start + 400]), return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"article {index} has only {ids.shape[1]} tokens")
    return ids


def generate_reference(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    cache = make_cache("fullkv", model, None, max_length=prompt.shape[1] + new)
    with torch.inference_mode():
        out = model.generate(prompt, **{cache_keyword(type(model)): cache}, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, :prompt.shape[1] + new]


def replay(model, sequence: torch.Tensor, prompt_len: int, method: str, config: QEvictConfig):
    cache = make_cache(method, model, config.replace(record_events=True), max_length=sequence.shape[1])
    with torch.inference_mode():
        call(model, sequence[:, :prompt_len], cache)
        for i in range(prompt_len, sequence.shape[1]):
            call(model, sequence[:, i:i + 1], cache)
    by_layer: dict[int, list] = {}
    for event in cache.events:
        by_layer.setdefault(event.layer, []).append(event)
    return cache, by_layer


def table_text(result: dict) -> str:
    """The diagnostics table of one run (diagnostics.json)."""
    conds = result["conditions"]
    lines = ["| condition | FMM (H=32) | FMM, quantized tier removed | churn | μ full | μ quantized | μ evicted | "
             "μ local | QSA | R_Q | QSA, decode mass | R_Q, decode mass | LIR policy | LIR oracle | P01(8) | P10(8) |",
             "|" + "---|" * 17]
    for name, c in conds.items():
        lagged8 = c["lagged"].get("8") or c["lagged"].get(8) or {}
        cells = [c["fmm"], c["fmm_fp_only"], c["churn"], *(c["tier_mass"][k] for k in ("full", "quantized", "evicted",
                 "local")), c["qsa"], c["r_q"], c.get("qsa_decode"), c.get("r_q_decode"), c["lir_policy"]["lir"],
                 c["lir_oracle"]["lir"], lagged8.get("P01"),
                 lagged8.get("P10")]
        lines.append(f"| {name} ({c['method']}, Ω={c['omega']}, K_f={c['k_full']}, K_q={c['k_quant']}) | "
                     + " | ".join("—" if v is None else f"{v:.4f}" for v in cells) + " |")
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"\n{name} not run: {reason}")
    return "\n".join(lines) + "\n"


def render(result: dict, out: Path) -> Path:
    conds = result["conditions"]
    table = out / "diagnostics_table.md"
    table.write_text(table_text(result))
    fig, ax = plt.subplots(figsize=(7, 4))
    figure = go.Figure()
    for name, c in conds.items():
        xs, ys = zip(*c["fmm_curve"]) if c["fmm_curve"] else ((), ())
        ax.plot(xs, ys, label=name)
        figure.add_trace(go.Scatter(x=xs, y=ys, name=name))
        if name == "R3" and c["fmm_fp_curve"]:
            xs, ys = zip(*c["fmm_fp_curve"])
            ax.plot(xs, ys, "--", label="R3, quantized tier inaccessible")
            figure.add_trace(go.Scatter(x=xs, y=ys, name="R3, quantized tier inaccessible", line={"dash": "dash"}))
    ax.set_xlabel("decode step")
    ax.set_ylabel("Future Missed Mass (H=32)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fmm_curve.png", dpi=120)
    plt.close(fig)
    figure.update_layout(xaxis={"title": "decode step"}, yaxis={"title": "FMM"}, template="plotly_white")
    figure.write_html(out / "fmm_curve.html", include_plotlyjs="cdn", div_id="fmm_curve")  # stable on re-runs
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tiers, colors = ["full", "quantized", "local", "evicted"], ["#16a34a", "#f59e0b", "#3b82f6", "#ef4444"]
    names = list(conds)
    left = [0.0] * len(names)
    for tier, color in zip(tiers, colors):
        values = [conds[n]["tier_mass"][tier] or 0 for n in names]
        ax.barh(names, values, left=left, color=color, label=tier)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("share of FullKV attention mass")
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(out / "tier_mass.png", dpi=120)
    plt.close(fig)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.conditions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--generate", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--sinks", type=int, default=5)
    parser.add_argument("--articles", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "diagnostics"))
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    collected: dict[str, list] = {name: [] for name in CONDITIONS}
    plans, skipped = {}, {}
    for index in tqdm(range(args.articles), desc="conditions", unit="article"):
        prompt = article(tokenizer, index, args.prefill) if args.model != "tiny" else \
            torch.randint(0, 256, (1, args.prefill), generator=torch.Generator().manual_seed(index))
        sequence = generate_reference(model, prompt, args.generate)
        traces = dg.reference_traces(model, sequence, args.prefill)
        for name, (method, overrides) in CONDITIONS.items():
            config = (QEvictConfig(budget=args.budget, sinks=args.sinks) if overrides is None else
                      QEvictConfig.paper(budget=args.budget, sinks=args.sinks, **overrides))
            try:
                cache, by_layer = replay(model, sequence, args.prefill, method, config)
            except ValueError as err:  # e.g. Ω=32's protected regions do not fit a small budget
                skipped[name] = str(err)
                continue
            plans[name] = (method, cache.config.omega, cache.plan.k_full, cache.plan.k_quant, kv_dtype(cache))
            collected[name].append((traces, cache, by_layer))
    conditions = {}
    for name, runs in collected.items():
        if name not in plans:
            continue
        method, omega, k_full, k_quant, stored = plans[name]
        # Pool both articles' layers into one average: the layer traces of article i go with its events.
        pooled = {}
        for i, (traces, cache, by_layer) in enumerate(runs):
            offset = i * len(traces)
            pooled.update({offset + layer: (traces[layer], events) for layer, events in by_layer.items()})
        result = dg.diagnose([t for t, _ in pooled.values()], {i: e for i, (_, e) in enumerate(pooled.values())},
                             args.prefill, runs[0][1].plan.num_windows, k_full, args.horizon)
        conditions[name] = {"method": method, "omega": omega, "k_full": k_full, "k_quant": k_quant,
                            "kv_dtype": stored, **result}
    result = {"meta": meta, "args": vars(args), "conditions": conditions, "skipped": skipped}
    (out / "diagnostics.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {render(json.loads(json.dumps(result)), out)}")


if __name__ == "__main__":
    main()
