"""The studio's words: what a run, its timing and its diagnostics say on the page, from what ``ui/studio.py``
returns. Markdown only; nothing here runs the model or reads storage."""

from __future__ import annotations

import math
import os
import statistics

import gradio as gr

from .studio import Diagnosis, Timing, Update

MEASURED_STEPS = 4  # decode steps of this run measured before a time left is shown
DIAGNOSTIC_COLUMNS = [("FMM (H=32)", "fmm"), ("FMM without the low-bit tier", "fmm_fp_only"), ("churn", "churn"),
                      ("QSA", "qsa"), ("R_Q", "r_q")]


def progress_text(update: Update) -> str:
    """Where the run stands, in words. A time left is shown only once this run has measured its own pace (the
    latest decode steps): an earlier run's, or the prompt's, would mislead on a machine whose load changes."""
    view = update.view
    if update.status != "running":
        return {"done": "**Done.**", "stopped": "**Stopped** — what was generated is kept.",
                "error": f"**Error:** {update.message}"}[update.status]
    steps = max((len(lane.tokens) for lane in view.lanes.values()), default=0)
    if steps == 0:
        tokens = int(view.request["prompt_length"])
        lanes = len(view.lanes)
        return f"**Reading the prompt** ({tokens:,} tokens, {lanes} lane{'s' if lanes > 1 else ''})…"
    paces = [statistics.median(lane.step_seconds[-8:]) for lane in view.lanes.values()
             if len(lane.step_seconds) >= MEASURED_STEPS and lane.done is None]
    left = view.max_new_tokens - steps
    eta = f", about {_duration(left * max(paces))} left at this run's pace" if paces and left > 0 else ""
    return f"**Generating…** token {steps} of at most {view.max_new_tokens}{eta}."


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, math.ceil(seconds))} s"
    return f"{seconds / 60:.0f} min"


def share_markdown(session_id: str, token: str, request: gr.Request | None) -> str:
    host = os.environ.get("SPACE_HOST")
    base = f"https://{host}" if host else (f"http://{request.headers.get('host')}" if request is not None else "")
    link = f"{base}/?session={session_id}"
    return (f"**Share this run:** [{link}]({link}) — anyone with the link can open it. It is listed under "
            f"*Sessions* in this browser only, which can delete it; elsewhere, delete it with the token `{token}`.")


def timing_markdown(timing: Timing) -> str:
    rows = [f"| {name} | {1000 * t['tpot']:.1f} | {t['ratio']:.3f} |" for name, t in timing.lanes.items()]
    return (f"Each lane alone on this run's prompt ({timing.prompt_tokens:,} tokens): {timing.steps} decode steps "
            f"of every lane, interleaved in one process, as `bench.tpot` measures (× {timing.baseline}: the ratio "
            "within the run; on a busy machine the times move, the ratios much less).\n\n"
            f"| lane | ms per token, alone | × {timing.baseline} |\n|---|---|---|\n" + "\n".join(rows))


def diagnostics_markdown(diagnosis: Diagnosis) -> str:
    if not diagnosis.routed:
        return "This run has no routed lane (QEvict or its ablations): nothing to diagnose."
    problems = "\n".join(f"- {problem}" for problem in diagnosis.problems)
    if not diagnosis.lanes:
        return "**This run cannot be diagnosed here.**\n\n" + problems
    columns = [name for name, _ in DIAGNOSTIC_COLUMNS] + ["μ full", "μ low-bit", "μ evicted", "LIR"]
    rows = ["| lane | " + " | ".join(columns) + " |", "|" + "---|" * (len(DIAGNOSTIC_COLUMNS) + 5)]
    for name, result in diagnosis.lanes.items():
        cells = [result[key] for _, key in DIAGNOSTIC_COLUMNS]
        cells += [result["tier_mass"][k] for k in ("full", "quantized", "evicted")] + [result["lir_policy"]["lir"]]
        rows.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.3f}" for c in cells) + " |")
    return ("Attention-drift diagnostics against FullKV attention over each lane's own tokens (Appendix I of the "
            "paper; see the glossary below): lower FMM is better; QSA near 1 means the low-bit scores rank like "
            "full precision.\n\n" + "\n".join(rows) + ("\n\n" + problems if problems else ""))
