"""The diagnostics on hand-made traces and events, where the right answer is known."""

import pytest
import torch

from qevict_core import diagnostics as dg

SINKS, OMEGA, PROMPT = 2, 4, 18  # windows 0..3 cover positions 2..17


def trace_attending(target_positions, total=30, decode=12):
    """Every decode query puts half its mass on ``target_positions`` and half on its own position."""
    rows = torch.zeros(decode, total)
    for d in range(decode):
        rows[d, PROMPT + d] = 0.5
        rows[d, target_positions] = 0.5 / len(target_positions)
    prefill = torch.zeros(total)
    prefill[:PROMPT] = 1.0
    return dg.LayerTrace(decode=rows, prefill_mass=prefill)


def event(seen, recent_start, full, quantized, scores=None):
    return {"seen": seen, "recent_start": recent_start, "full": full, "quantized": quantized, "promoted": [],
            "demoted": [], "evicted": [], "scores": scores or {}}


def test_future_missed_mass_counts_attention_on_evicted_windows():
    trace = trace_attending([10, 11])  # positions 10-11 lie in window 2
    kept_all = event(PROMPT, 18, full=[0, 1, 2], quantized=[3])
    evicted_2 = event(PROMPT, 18, full=[0, 1], quantized=[3])
    quantized_2 = event(PROMPT, 18, full=[0, 1], quantized=[2, 3])
    assert dg.future_missed_mass(trace, [kept_all], PROMPT, SINKS, OMEGA, horizon=4)[0][1] == 0.0
    # The next 4 queries: 0.5 on window 2 each, 0.5 on themselves (positions that did not exist yet -> excluded).
    assert dg.future_missed_mass(trace, [evicted_2], PROMPT, SINKS, OMEGA, horizon=4)[0][1] == pytest.approx(1.0)
    missed = dg.future_missed_mass(trace, [quantized_2], PROMPT, SINKS, OMEGA, horizon=4, include_quantized=False)
    assert missed[0][1] == pytest.approx(1.0)
    assert dg.future_missed_mass(trace, [quantized_2], PROMPT, SINKS, OMEGA, horizon=4)[0][1] == 0.0


def test_churn_tier_mass_and_score_agreement():
    trace = trace_attending([10, 11])
    events = [event(22, 18, full=[2], quantized=[0, 1]), event(26, 22, full=[2], quantized=[0, 3])]
    assert dg.selection_churn(events, SINKS, OMEGA) == [pytest.approx(1 - 2 / 4)]  # {0,1,2} vs {0,2,3}∩{0..3}
    mass = dg.tier_mass(trace, events[:1], PROMPT, SINKS, OMEGA, num_windows=7)
    # At 22 tokens: 18 prompt rows + 4 decode rows of mass 1. Window 2 holds 4 + 4*0.5, windows 0-1 hold 8,
    # the sinks and the recent region 2 + 4*0.5, the evicted window 3 holds 4.
    assert mass == pytest.approx({"full": 6 / 22, "quantized": 8 / 22, "local": 4 / 22, "evicted": 4 / 22})
    reference = dg.reference_scores(trace, PROMPT, 22, SINKS, OMEGA, 7)
    own = {0: float(reference[0]) * 2, 1: float(reference[1]) * 2}  # proportional: cosine 1, mass ratio 2
    qsa, r_q = dg.quantized_score_agreement(trace, [event(22, 18, [2], [0, 1], own)], PROMPT, SINKS, OMEGA, 7)
    assert qsa == [pytest.approx(1.0)] and r_q == [pytest.approx(2.0)]


def test_global_lir_and_lagged_transitions():
    series = {0: [1, 0, 0, 0, 1, 1], 1: [1, 0, 0, 0, 0, 0], 2: [1, 1, 0, 1, 1, 1], 3: [None, None, 0, 0, 0, 0]}
    lir, median_return, eligible = dg.global_lir(series, m=3)
    # window 0 leaves and returns after 3 events (rescued), window 1 never returns, window 2's gap is too short.
    assert (lir, median_return, eligible) == (0.5, 3, 2)
    lagged = dg.lagged_transitions(series, max_lag=1)[1]
    assert lagged["P10"] == pytest.approx(3 / 7) and lagged["P01"] == pytest.approx(2 / 11)
