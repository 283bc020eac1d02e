"""The paper's attention-drift diagnostics (Section 3, Appendix I), from FullKV attention traces.

A policy's decisions come from its own routing events (``RoutingEvent``: what it kept at each event, on which
window grid); the attention it will miss comes from an uncompressed FullKV run over the same tokens, the only place
that attention exists. Routing is shared by a layer's heads; FMM and tier mass are computed per layer and head as
Appendix I.1 defines them (Eq. 12 per head), then averaged. QSA and the oracle compare with the policy's own
ranking, which is per layer (Eq. 1 averages the query heads), so their reference scores are the mean over query
heads: the policy records no per-head scores to compare head by head.

- Future Missed Mass (Eq. 13): per head, future FullKV attention (next H queries) on positions a policy has made
  inaccessible, over the attention on all positions that existed at the event; then averaged over heads.
- Selection Churn (Eq. 14): Jaccard distance between the historical sets retained after consecutive events (full
  and quantized windows, whatever their age; only the protected recent region is excluded, as the paper notes).
- Tier mass μ(z) (Eq. 15): per head, the share of FullKV cumulative scores over the windows (the sinks are no
  window) held by each tier, local being the recent region; then averaged over heads.
- QSA and R_Q (Eq. 16-17): agreement of the policy's own scores for its quantized windows with FullKV's, on the
  cumulative scores and on the decode-interval mass alone (cumulative scores share the prompt's mass, which
  makes QSA close to 1 whatever happens while decoding).
- Global LIR (Eq. 18) and lagged transitions P_ab(Δ) (Eq. 19) of full-tier membership, for the policy and for the
  oracle top-K_f of FullKV's ranking. Every maximal run of X = 0 is an inactive episode, also one that opens a
  window's series (a window not selected yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

import torch

from .engine.layout import WindowGrid
from .events import RoutingEvent


@dataclass
class LayerTrace:
    """FullKV attention of one layer: ``heads`` (H, T_dec, T) rows of the generated tokens per query head and
    ``prefill_mass`` (T,) column sums of the prompt rows averaged over heads (for cumulative reference scores);
    ``prefill_heads`` (H, T) the same sums per query head, when known."""

    heads: torch.Tensor
    prefill_mass: torch.Tensor
    prefill_heads: torch.Tensor | None = None

    @property
    def decode(self) -> torch.Tensor:
        """(T_dec, T) decode rows averaged over query heads."""
        return self.heads.mean(dim=0)

    def group(self, kv_head: int, kv_heads: int) -> LayerTrace:
        """The trace of the query heads that read KV head ``kv_head`` (GQA: G consecutive heads): what a cache
        that routes that head on its own (``qevict_head``) ranks by."""
        g = self.heads.shape[0] // kv_heads
        rows = slice(kv_head * g, (kv_head + 1) * g)
        prefill = self.prefill_heads[rows] if self.prefill_heads is not None else None
        return LayerTrace(heads=self.heads[rows], prefill_mass=prefill.mean(0) if prefill is not None
                          else self.prefill_mass, prefill_heads=prefill)


def reference_traces(model, input_ids: torch.Tensor, prompt_len: int) -> list[LayerTrace]:
    """Eager attention of the uncompressed model over the whole sequence, reduced layer by layer to head means
    as the forward runs (a hook per attention module), so only one layer's T x T probabilities exist at a time."""
    traces: dict[int, LayerTrace] = {}

    def keep(module, _inputs, output):
        probs = output[1][0].float()  # (H, T, T)
        prefill = probs[:, :prompt_len].sum(1)  # (H, T)
        traces[module.layer_idx] = LayerTrace(heads=probs[:, prompt_len:].clone(), prefill_mass=prefill.mean(0),
                                              prefill_heads=prefill)
        return output[0], None

    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    hooks = [m.register_forward_hook(keep) for m in modules]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            model(input_ids)
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    return [traces[i] for i in sorted(traces)]


def reference_scores(trace: LayerTrace, prompt_len: int, seen: int, sinks: int, omega: int,
                     num_windows: int, with_prefill: bool = True) -> torch.Tensor:
    """Eq. 12 per window at the event where ``seen`` tokens exist: prompt rows (unless ``with_prefill`` is False)
    plus decode rows up to it."""
    mass = trace.prefill_mass.clone() if with_prefill else torch.zeros_like(trace.prefill_mass)
    decoded = seen - prompt_len
    if decoded > 0:
        mass += trace.heads[:, :decoded].sum(1).mean(0)
    per_token = mass[sinks:seen]
    windows = torch.zeros(num_windows)
    ids = WindowGrid(sinks, omega).window_of(torch.arange(sinks, sinks + per_token.shape[0]))  # window of each token
    windows.scatter_add_(0, ids[ids < num_windows], per_token[:ids.shape[0]][ids < num_windows])
    return windows


def _historical(event: RoutingEvent) -> int:
    """Number of windows that have left the recent region at this event."""
    return event.grid.window_of(event.recent_start)


def accessible_positions(event: RoutingEvent, include_quantized: bool = True) -> set[int]:
    kept = set(event.full) | (set(event.quantized) if include_quantized else set())
    grid = event.grid
    positions = set(range(min(grid.sinks, event.seen)))
    positions |= {grid.start(w) + i for w in kept for i in range(grid.omega)}
    positions |= set(range(event.recent_start, event.seen))
    return positions


def future_missed_mass(trace: LayerTrace, events: list[RoutingEvent], prompt_len: int, horizon: int = 32,
                       include_quantized: bool = True) -> list[tuple[int, float]]:
    """(decode step, FMM averaged over heads) per routing event; ``include_quantized=False`` treats the low-bit
    tier as gone. Heads whose future rows put no mass on existing positions have no FMM and are left out."""
    out = []
    total_decoded = trace.heads.shape[1]
    for event in events:
        seen = event.seen
        first, last = seen - prompt_len, min(seen - prompt_len + horizon, total_decoded)
        if first >= last:
            continue
        future = trace.heads[:, first:last, :seen]  # (H, rows of queries after the event, keys that existed)
        kept = torch.zeros(seen, dtype=torch.bool)
        kept[list(accessible_positions(event, include_quantized))] = True
        denominator = future.sum(dim=(1, 2))
        valid = denominator > 0
        if valid.any():
            per_head = future[:, :, ~kept].sum(dim=(1, 2))[valid] / denominator[valid]
            out.append((first, per_head.mean().item()))
    return out


def selection_churn(events: list[RoutingEvent]) -> list[float]:
    """Eq. 14 per pair of consecutive events. Full and quantized windows are historical by construction (the
    recent region is never routed), and every window holds Ω positions, so the Jaccard distance of the windows is
    that of the expanded positions."""
    out = []
    for before, after in zip(events, events[1:]):
        kept_before = set(before.full) | set(before.quantized)
        kept_after = set(after.full) | set(after.quantized)
        union = kept_before | kept_after
        if union:
            out.append(1 - len(kept_before & kept_after) / len(union))
    return out


def tier_mass(trace: LayerTrace, events: list[RoutingEvent], prompt_len: int) -> dict[str, float]:
    """Eq. 15 as the paper states it: per query head, each tier's share of the FullKV cumulative scores (Eq. 12,
    that head's attention) summed over the windows W_t, the windows after the sink prefix; ``local`` is the
    protected recent region's windows; the sinks are no window and count nowhere. Averaged over heads, then over
    events."""
    shares = {"full": [], "quantized": [], "evicted": [], "local": []}
    per_head_prefill = trace.prefill_heads if trace.prefill_heads is not None else trace.prefill_mass[None]
    for event in events:
        seen, sinks = event.seen, event.grid.sinks
        mass = per_head_prefill.clone()  # (H, T)
        if seen > prompt_len:
            decoded = trace.heads[:, :seen - prompt_len].sum(1)  # (H, T)
            mass = mass + (decoded if mass.shape[0] == decoded.shape[0] else decoded.mean(0, keepdim=True))
        windows = mass[:, sinks:seen]  # (H, positions of W_t)
        total = windows.sum(1)  # (H,)
        valid = total > 0
        if not valid.any():
            continue
        offset = torch.arange(sinks, seen)
        window_of = event.grid.window_of(offset)
        full = torch.isin(window_of, torch.tensor(event.full, dtype=torch.long))
        quant = torch.isin(window_of, torch.tensor(event.quantized, dtype=torch.long)) & ~full
        local = offset >= event.recent_start
        full, quant = full & ~local, quant & ~local
        tiers = {"full": full, "quantized": quant, "local": local, "evicted": ~(full | quant | local)}
        for name, where in tiers.items():
            shares[name].append((windows[:, where].sum(1)[valid] / total[valid]).mean().item())
    return {name: sum(v) / len(v) if v else 0.0 for name, v in shares.items()}


def _score(event: RoutingEvent, window: int) -> float | None:
    value = event.scores.get(window)
    return None if value is None else float(value)


def quantized_score_agreement(trace: LayerTrace, events: list[RoutingEvent], prompt_len: int, num_windows: int,
                              decode_only: bool = False) -> tuple[list[float], list[float]]:
    """(QSA, R_Q) per event with a non-empty quantized tier: cosine and mass ratio of the policy's own scores of its
    quantized windows against FullKV's cumulative scores of the same windows. ``decode_only``: both sides without
    the prompt's mass — the policy's score at the end-of-prefill event (``events[0]``, 0 for a window that did
    not exist yet) is subtracted, and FullKV's prompt rows are left out."""
    qsa, ratio = [], []
    prefill = events[0] if events and events[0].seen == prompt_len else None
    for event in events[1:] if decode_only else events:
        windows = [w for w in event.quantized if _score(event, w) is not None]
        if not windows:
            continue
        own = torch.tensor([_score(event, w) for w in windows])
        if decode_only:
            own -= torch.tensor([(_score(prefill, w) or 0.0) if prefill else 0.0 for w in windows])
        ref = reference_scores(trace, prompt_len, event.seen, event.sinks, event.omega, num_windows,
                               with_prefill=not decode_only)[windows]
        if own.norm() > 0 and ref.norm() > 0:
            qsa.append(torch.nn.functional.cosine_similarity(own, ref, dim=0).item())
            ratio.append(own.sum().item() / ref.sum().item())
    return qsa, ratio


def membership(events: list[RoutingEvent], selected: list[set[int]]) -> dict[int, list[int | None]]:
    """Per window, its 0/1 membership in ``selected`` at each event (None before it left the recent region)."""
    num = max((_historical(e) for e in events), default=0)
    out = {w: [] for w in range(num)}
    for event, chosen in zip(events, selected):
        historical = _historical(event)
        for w in range(num):
            out[w].append(None if w >= historical else int(w in chosen))
    return out


def oracle_selection(trace: LayerTrace, events: list[RoutingEvent], prompt_len: int, num_windows: int,
                     k_full: int) -> list[set[int]]:
    """Top-K_f historical windows of FullKV's cumulative ranking at every event."""
    out = []
    for event in events:
        historical = _historical(event)
        scores = reference_scores(trace, prompt_len, event.seen, event.sinks, event.omega, num_windows)[:historical]
        out.append(set(scores.topk(min(k_full, historical)).indices.tolist()) if historical else set())
    return out


def global_lir(series: dict[int, list[int | None]], m: int = 3) -> tuple[float, float | None, int]:
    """(LIR, median events to return, eligible episodes) by Eq. 18: every maximal run of X = 0 is an episode, also
    one that opens the series; it is eligible once it lasts m events and rescued if the window comes back before
    the end (an episode still open at the end stays in the denominator)."""
    eligible, returns = 0, []
    for states in series.values():
        states = [s for s in states if s is not None]
        i = 0
        while i < len(states):
            if states[i] == 0:
                j = i
                while j < len(states) and states[j] == 0:
                    j += 1
                if j - i >= m:
                    eligible += 1
                    if j < len(states):
                        returns.append(j - i)
                i = j
            else:
                i += 1
    lir = len(returns) / eligible if eligible else 0.0
    return lir, (median(returns) if returns else None), eligible


def lagged_transitions(series: dict[int, list[int | None]], max_lag: int = 8) -> dict[int, dict[str, float]]:
    """P_01(Δ) and P_10(Δ) for Δ = 1..max_lag over windows present at both events."""
    out = {}
    for lag in range(1, max_lag + 1):
        counts = {"00": 0, "01": 0, "10": 0, "11": 0}
        for states in series.values():
            for a, b in zip(states, states[lag:]):
                if a is not None and b is not None:
                    counts[f"{a}{b}"] += 1
        zeros, ones = counts["00"] + counts["01"], counts["10"] + counts["11"]
        out[lag] = {"P01": counts["01"] / zeros if zeros else 0.0, "P10": counts["10"] / ones if ones else 0.0}
    return out


def diagnose(traces: list[LayerTrace], events_by_layer: dict[int, list[RoutingEvent]], prompt_len: int,
             num_windows: int, k_full: int, horizon: int = 32, max_lag: int = 8, m: int = 3) -> dict:
    """Every diagnostic for one policy run, averaged over layers: the numbers of the paper's Table 14-16. A run
    routed per KV head (events with a ``head``) is scored per layer and head, each head against the attention of
    its own query group, and averaged over both."""
    per_layer = []
    for layer, trace, events in _routing_units(traces, events_by_layer):
        decode = [e for e in events if e.seen >= prompt_len]
        policy = membership(decode, [set(e.full) for e in decode])
        oracle = membership(decode, oracle_selection(trace, decode, prompt_len, num_windows, k_full))
        qsa, r_q = quantized_score_agreement(trace, decode, prompt_len, num_windows)
        qsa_dec, r_q_dec = quantized_score_agreement(trace, decode, prompt_len, num_windows, decode_only=True)
        per_layer.append({
            "fmm": future_missed_mass(trace, decode, prompt_len, horizon),
            "fmm_fp": future_missed_mass(trace, decode, prompt_len, horizon, include_quantized=False),
            "churn": selection_churn(decode), "qsa": qsa, "r_q": r_q, "qsa_decode": qsa_dec,
            "r_q_decode": r_q_dec,
            "tier_mass": tier_mass(trace, decode, prompt_len),
            "lir_policy": global_lir(policy, m), "lir_oracle": global_lir(oracle, m),
            "lagged": lagged_transitions(policy, max_lag)})
    return aggregate(per_layer)


def _routing_units(traces: list[LayerTrace], events_by_layer: dict[int, list[RoutingEvent]]):
    """(layer, trace, events) per unit that routing decided for: a layer, or each KV head of a layer."""
    for layer, events in sorted(events_by_layer.items()):
        heads = sorted({e.head for e in events if e.head is not None})
        if not heads:
            yield layer, traces[layer], events
            continue
        for head in heads:
            yield layer, traces[layer].group(head, heads[-1] + 1), [e for e in events if e.head == head]


def aggregate(layers: list[dict]) -> dict:
    def avg(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    steps = sorted({s for layer in layers for s, _ in layer["fmm"]})
    lags = layers[0]["lagged"].keys() if layers else []
    return {
        "fmm": avg([v for layer in layers for _, v in layer["fmm"]]),
        "fmm_fp_only": avg([v for layer in layers for _, v in layer["fmm_fp"]]),
        "churn": avg([v for layer in layers for v in layer["churn"]]),
        "tier_mass": {k: avg([layer["tier_mass"][k] for layer in layers])
                      for k in ("full", "quantized", "evicted", "local")},
        "qsa": avg([v for layer in layers for v in layer["qsa"]]),
        "r_q": avg([v for layer in layers for v in layer["r_q"]]),
        "qsa_decode": avg([v for layer in layers for v in layer["qsa_decode"]]),
        "r_q_decode": avg([v for layer in layers for v in layer["r_q_decode"]]),
        "lir_policy": _pooled_lir([layer["lir_policy"] for layer in layers]),
        "lir_oracle": _pooled_lir([layer["lir_oracle"] for layer in layers]),
        "lagged": {lag: {k: avg([layer["lagged"][lag][k] for layer in layers]) for k in ("P01", "P10")}
                   for lag in lags},
        "fmm_curve": [(s, avg([dict(layer["fmm"]).get(s) for layer in layers])) for s in steps],
        "fmm_fp_curve": [(s, avg([dict(layer["fmm_fp"]).get(s) for layer in layers])) for s in steps],
    }


def _pooled_lir(results) -> dict:
    eligible = sum(r[2] for r in results)
    rescued = sum(round(r[0] * r[2]) for r in results)
    medians = [r[1] for r in results if r[1] is not None]
    return {"lir": rescued / eligible if eligible else 0.0, "eligible": eligible,
            "median_return_events": sum(medians) / len(medians) if medians else None}
