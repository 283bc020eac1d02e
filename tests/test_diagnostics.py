"""The diagnostics on hand-made traces and events, where the right answer is known."""

from dataclasses import replace

import pytest
import torch

from qevict_core import diagnostics as dg
from qevict_core.events import RoutingEvent

SINKS, OMEGA, PROMPT = 2, 4, 18  # windows 0..3 cover positions 2..17


def trace_attending(target_positions, total=30, decode=12):
    """Every decode query puts half its mass on ``target_positions`` and half on its own position."""
    rows = torch.zeros(decode, total)
    for d in range(decode):
        rows[d, PROMPT + d] = 0.5
        rows[d, target_positions] = 0.5 / len(target_positions)
    prefill = torch.zeros(total)
    prefill[:PROMPT] = 1.0
    return dg.LayerTrace(heads=rows[None], prefill_mass=prefill)


def event(seen, recent_start, full, quantized, scores=None, head=None):
    return RoutingEvent(lane="q", step=seen - PROMPT, layer=0, seen=seen, recent_start=recent_start, sinks=SINKS,
                        omega=OMEGA, full=full, quantized=quantized, promoted=[], demoted=[], evicted=[],
                        scores=scores or {}, head=head)


def test_future_missed_mass_counts_attention_on_evicted_windows():
    trace = trace_attending([10, 11])  # positions 10-11 lie in window 2
    kept_all = event(PROMPT, 18, full=[0, 1, 2], quantized=[3])
    evicted_2 = event(PROMPT, 18, full=[0, 1], quantized=[3])
    quantized_2 = event(PROMPT, 18, full=[0, 1], quantized=[2, 3])
    assert dg.future_missed_mass(trace, [kept_all], PROMPT, horizon=4)[0][1] == 0.0
    # The next 4 queries: 0.5 on window 2 each, 0.5 on themselves (positions that did not exist yet -> excluded).
    assert dg.future_missed_mass(trace, [evicted_2], PROMPT, horizon=4)[0][1] == pytest.approx(1.0)
    missed = dg.future_missed_mass(trace, [quantized_2], PROMPT, horizon=4, include_quantized=False)
    assert missed[0][1] == pytest.approx(1.0)
    assert dg.future_missed_mass(trace, [quantized_2], PROMPT, horizon=4)[0][1] == 0.0


def test_future_missed_mass_is_per_head_then_averaged():
    """Eq. 13 is defined per layer and head (Appendix I.1): the mean of the heads' ratios, not the ratio of
    head-averaged attention."""
    decode, total = 6, 30
    heads = torch.zeros(2, decode, total)
    heads[0, :, 10] = 1.0  # head 0: everything on window 2
    for d in range(decode):  # head 1: half on itself (did not exist at the event), 0.45 on window 0, 0.05 on 2
        heads[1, d, PROMPT + d] = 0.5
    heads[1, :, 3] = 0.45
    heads[1, :, 10] = 0.05
    trace = dg.LayerTrace(heads=heads, prefill_mass=torch.ones(total))
    evicted_2 = event(PROMPT, 18, full=[0, 1], quantized=[3])
    fmm = dg.future_missed_mass(trace, [evicted_2], PROMPT, horizon=4)[0][1]
    assert fmm == pytest.approx((1.0 + 0.05 / 0.5) / 2)  # 0.55; the head-averaged trace would give 1.05/1.5 = 0.7


def test_churn_is_over_every_retained_historical_window():
    # Window 4 leaves the recent region at the second event and is kept: Eq. 14 counts it (the old restriction
    # to windows historical at the first event gave 0 here).
    events = [event(22, 18, full=[0], quantized=[1]), event(26, 22, full=[0, 4], quantized=[1])]
    assert dg.selection_churn(events) == [pytest.approx(1 - 2 / 3)]


def test_churn_tier_mass_and_score_agreement():
    trace = trace_attending([10, 11])
    events = [event(22, 18, full=[2], quantized=[0, 1]), event(26, 22, full=[2], quantized=[0, 3])]
    assert dg.selection_churn(events) == [pytest.approx(1 - 2 / 4)]  # {0,1,2} vs {0,2,3}
    mass = dg.tier_mass(trace, events[:1], PROMPT)
    # At 22 tokens: 18 prompt rows + 4 decode rows of mass 1. Over the windows (positions 2-21; the sinks' 2 are no
    # window): window 2 holds 4 + 4*0.5, windows 0-1 hold 8, the recent region 4*0.5, the evicted window 3 holds 4.
    assert mass == pytest.approx({"full": 6 / 20, "quantized": 8 / 20, "local": 2 / 20, "evicted": 4 / 20})
    reference = dg.reference_scores(trace, PROMPT, 22, SINKS, OMEGA, 7)
    own = {0: float(reference[0]) * 2, 1: float(reference[1]) * 2}  # proportional: cosine 1, mass ratio 2
    qsa, r_q = dg.quantized_score_agreement(trace, [event(22, 18, [2], [0, 1], own)], PROMPT, 7)
    assert qsa == [pytest.approx(1.0)] and r_q == [pytest.approx(2.0)]


def test_quantized_score_agreement_on_the_decode_interval():
    trace = trace_attending([10, 11])  # decode rows put 0.5 on window 2 (positions 10-11) and 0.5 on themselves
    prefill = event(PROMPT, 18, full=[], quantized=[2, 3], scores={2: 5.0, 3: 7.0})
    # Four decode rows later FullKV's decode-interval mass is 2.0 on window 2 and 0 on window 3; the policy's own
    # scores grew by 1.0 on window 2 and 0.5 on window 3.
    later = event(22, 18, full=[], quantized=[2, 3], scores={2: 6.0, 3: 7.5})
    qsa, r_q = dg.quantized_score_agreement(trace, [prefill, later], PROMPT, 7, decode_only=True)
    assert qsa == [pytest.approx(1.0 / (1.0 ** 2 + 0.5 ** 2) ** 0.5)]  # cos((1, 0.5), (2, 0))
    assert r_q == [pytest.approx(1.5 / 2.0)]
    # On cumulative scores the shared prompt mass (4 per window) dominates and hides the disagreement.
    qsa_all, _ = dg.quantized_score_agreement(trace, [prefill, later], PROMPT, 7)
    assert qsa_all[1] > 0.95 > qsa[0]


def test_global_lir_counts_every_maximal_inactive_run():
    # The toy series: three runs of three zeros, the first two end with a return. Eq. 18: 2 / 3.
    assert dg.global_lir({0: [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]}, m=3) == (2 / 3, 3, 3)


def test_global_lir_and_lagged_transitions():
    series = {0: [1, 0, 0, 0, 1, 1], 1: [1, 0, 0, 0, 0, 0], 2: [1, 1, 0, 1, 1, 1], 3: [None, None, 0, 0, 0, 0]}
    lir, median_return, eligible = dg.global_lir(series, m=3)
    # window 0 returns after 3 inactive events (rescued); window 1 never returns; window 2's gap is too short;
    # window 3 was never selected: its opening run of 4 zeros is an episode too, not rescued.
    assert (lir, median_return, eligible) == (1 / 3, 3, 3)
    lagged = dg.lagged_transitions(series, max_lag=1)[1]
    assert lagged["P10"] == pytest.approx(3 / 7) and lagged["P01"] == pytest.approx(2 / 11)


def test_a_run_routed_per_kv_head_is_scored_against_each_heads_own_query_group():
    """Two KV heads, one query head each: head 0 reads window 2 and keeps it, head 1 reads window 0 and keeps it.
    Scored per head nothing is missed; a per-layer reading of the same events would mix the heads' choices."""
    decode, total = 6, 30
    heads = torch.zeros(2, decode, total)
    heads[0, :, 10] = 1.0  # window 2
    heads[1, :, 3] = 1.0  # window 0
    trace = dg.LayerTrace(heads=heads, prefill_mass=torch.ones(total), prefill_heads=torch.ones(2, total))
    per_head = [event(PROMPT, 18, full=[2], quantized=[], head=0), event(PROMPT, 18, full=[0], quantized=[], head=1)]
    result = dg.diagnose([trace], {0: per_head}, PROMPT, num_windows=7, k_full=1, horizon=4)
    assert result["fmm"] == 0.0
    assert trace.group(1, 2).heads.equal(heads[1:]) and trace.group(1, 2).prefill_mass.equal(torch.ones(total))
    swapped = [replace(per_head[0], head=1), replace(per_head[1], head=0)]
    assert dg.diagnose([trace], {0: swapped}, PROMPT, num_windows=7, k_full=1,
                       horizon=4)["fmm"] == pytest.approx(1.0)


def test_tier_mass_is_per_head_then_averaged_and_leaves_the_sinks_out():
    """Two heads: one attends only to window 0 (quantized), the other only to the sinks and window 1 (evicted).
    Eq. 15 per head: head 0 puts all its window mass on the quantized tier, head 1 all of it on the evicted one;
    the sinks' mass counts nowhere. The mean over heads gives 1/2 each (the mean over heads of the attention,
    weighting head 1's window mass by a half, would give 2/3 and 1/3)."""
    total, decode = 30, 4
    heads = torch.zeros(2, decode, total)
    heads[0, :, 2:6] = 0.25  # window 0
    heads[1, :, 0:2] = 0.25  # the sinks
    heads[1, :, 6:10] = 0.125  # window 1
    trace = dg.LayerTrace(heads=heads, prefill_mass=torch.zeros(total), prefill_heads=torch.zeros(2, total))
    mass = dg.tier_mass(trace, [event(22, 18, full=[], quantized=[0])], PROMPT)
    assert mass == pytest.approx({"full": 0.0, "quantized": 0.5, "local": 0.0, "evicted": 0.5})
