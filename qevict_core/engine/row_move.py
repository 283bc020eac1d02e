"""One routing move of a layer, for every batch row at once (Algorithm 1, lines 5-21): QEvict's per-layer routing;
its decision (``decide_rows``) for one layer or for every layer of a forward at once.

The decision (``routing.route_windows``) ranks the candidates - the quantized tier, the full tier and the windows
aging out of the recent region - and moves are gathers from the keys the move is given: a row layer's own
full-precision buffer (its event waits for the forward's end, cache.py), from which each row dequantizes the windows
it promotes, or a per-head layer's workspace with its low-bit tier dequantized in front, from which promotion copies
the window; demotion reuses the window's dormant ledger record when it has one and quantizes it (once, ever) when it
does not. The records the new quantized tier needs and has not got are quantized first and joined with ``[quantized
| dormant]`` in one copy, from which the quantized tier and the dormant ledger each take their windows with one
selection, written into the layer's own storage (``keep_selected``, ``keep_moved``). A per-head cache's move of
every head at once is head_move.py; every layer as rows of one move, layer_stack.py.
"""

from __future__ import annotations

import torch

from .layout import gather_seq
from .ledger import WindowLedger
from .rope import unrotate
from .routing import RoutingDecision, route_windows


def settle(layer) -> None:
    """Finish a layer's score table for ranking: the scorer's interval, then the windows leaving the recent region."""
    scorer = layer.owner.scorer
    scorer.settle(layer.scores, layer.interval)
    if scorer.reads_aged_keys:
        aged = layer.aged_windows()
        if aged.shape[1]:
            scorer.on_aged(layer.scores, aged, layer.recent_k[:, :, :aged.shape[1] * layer.grid.omega])


def decide_rows(layers: list) -> list[tuple[torch.Tensor, RoutingDecision]]:
    """Algorithm 1's ranking and split (routing.py) of one layer's settled candidates, or of several layers' at once
    as rows of one decision: the layers of a row cache hold tiers of the same sizes and age the same windows out of
    their recent regions (one schedule, one plan), so their candidates stack and the decision costs one set of
    operators for the whole model. -> each layer's (cand_ids (B, C) [quantized | full | aged], decision)."""
    first = layers[0]
    if len(layers) == 1:
        cand = first.candidates()[None]  # (1, B, C)
        ranks = first.candidate_ranks(cand[0])[None]
    else:
        cand = torch.cat([torch.stack([layer.quant.ids for layer in layers]),
                          torch.stack([layer.full_ids for layer in layers]),
                          first.aged_windows().expand(len(layers), -1, -1)], dim=2)  # (L, B, C)
        ranks = first.owner.scorer.rank(torch.stack([layer.scores for layer in layers])).gather(2, cand.long())
    b = cand.shape[1]
    k_full, k_quant = first.capacities()
    both = route_windows(ranks.flatten(0, 1), cand.flatten(0, 1), first.quant.num_windows, k_full, k_quant,
                         first.owner.config.promotion)  # rows (L·B, ·), layer-major
    return [(cand[i], RoutingDecision(both.full[i * b:(i + 1) * b], both.quant[i * b:(i + 1) * b],
                                      both.num_candidates)) for i in range(len(layers))]


def move_rows(layer, keys: torch.Tensor, values: torch.Tensor, cand_ids: torch.Tensor,
              decision: RoutingDecision) -> None:
    """``keys``/``values`` in the order [quantized | sinks | full | recent], or without the quantized tier (the
    layer's own buffer: then each row dequantizes only the windows it promotes); ``decision`` over ``cand_ids``
    (``decide_rows``)."""
    owner, grid, omega = layer.owner, layer.grid, layer.grid.omega
    n_quant, n_full = layer.quant.num_windows, layer.full_ids.shape[1]
    aged_ids = cand_ids[:, n_quant + n_full:]
    num_aged = aged_ids.shape[1]
    has_record = torch.cat([torch.ones_like(layer.quant.ids, dtype=torch.bool),
                            layer.dormant_valid if layer.dormant is not None
                            else torch.zeros_like(layer.full_ids, dtype=torch.bool),
                            torch.zeros_like(aged_ids, dtype=torch.bool)], dim=1)
    # copies: a move rewrites the tiers in place
    old = (layer.full_ids.clone(), layer.quant.ids.clone()) if owner.config.record_events else None
    # Where each candidate's tokens start in ``keys``: [quant | sinks | full | recent (aged first)]; without the
    # quantized tier in ``keys`` its candidates start nowhere (0: their full-tier tokens come from _promoted).
    fp_tokens = layer.fp.capacity if layer.reads_buffer else layer.fp.length  # what ``keys`` ends with
    tier_in_keys = keys.shape[2] > fp_tokens
    fp_start = keys.shape[2] - fp_tokens + layer.fp.sinks  # past [quant | sinks]
    quant_starts = torch.arange(n_quant, device=keys.device) * omega if tier_in_keys else \
        torch.zeros(n_quant, dtype=torch.long, device=keys.device)
    starts = torch.cat([quant_starts, fp_start + torch.arange(n_full + num_aged, device=keys.device) * omega])

    full_tok = _token_index(starts, decision.full, omega)
    stored = owner.shape.dtype  # ``keys`` may be attention's workspace, in the model's dtype
    flat = owner.backend.gathers_by_flat_index
    full_k, full_v = gather_seq(keys, full_tok, flat=flat), gather_seq(values, full_tok, flat=flat)
    if not tier_in_keys and n_quant:
        full_k, full_v = _promoted(layer, full_k, full_v, decision, n_quant)

    # Records of the candidates: [quantized | dormant (aligned with the full tier)], which index candidates
    # directly, then records quantized now for the quantized tier's windows that have none (aged windows;
    # demoted ones without a dormant record). One copy joins them and one selection per tier picks from it.
    records = [layer.quant] + ([layer.dormant] if layer.dormant is not None else [])
    n_records = sum(r.num_windows for r in records)
    quant_idx = decision.quant
    need = ~has_record.gather(1, decision.quant)
    if owner.backend.sizes_moves_on_host:
        m = int(need.sum(1).max()) if need.any() else 0
    else:  # an aged window or a full one without a dormant record: a bound the host knows
        m = min(decision.quant.shape[1], num_aged + n_full)
    if m:
        slots = need.int().argsort(dim=1, descending=True, stable=True)[:, :m]  # the windows that need one first
        chosen, needed = decision.quant.gather(1, slots), need.gather(1, slots)
        tok = _token_index(starts, chosen, omega)
        positions = grid.positions(cand_ids.gather(1, chosen))
        pre_rope = unrotate(gather_seq(keys, tok, flat=flat), *owner.cos_sin(keys, positions))
        on_host = owner.backend.sizes_moves_on_host  # else the scales' check is read back later
        fresh, unfit = WindowLedger.quantize_on(owner.backend, pre_rope, gather_seq(values, tok, flat=flat),
                                                cand_ids.gather(1, chosen), omega, owner.config.bits,
                                                owner.config.param_dtype(stored), check=on_host)
        if not on_host:
            owner.note_unfit(unfit & needed)
        records.append(fresh)
        fresh_idx = n_records + torch.arange(m, device=keys.device).expand_as(slots)
        quant_idx = quant_idx.scatter(1, slots, torch.where(needed, fresh_idx, chosen))
    joined = records[0].cat(*records[1:]) if len(records) > 1 else records[0]
    if joined.num_windows == 0:  # nothing quantized yet: every kept record is a placeholder, flagged invalid
        b, h, _, d = keys.shape
        joined = WindowLedger.empty(b, h, d, omega, owner.config.bits, joined.k_scale.dtype, keys.device, 1)
    last = joined.num_windows - 1  # candidates without a record read the last one (flagged invalid)
    dormant = layer.dormant is not None
    layer.keep_selected(joined, quant_idx.clamp(max=last), decision.full.clamp(max=last) if dormant else None,
                        has_record.gather(1, decision.full) if dormant else layer.dormant_valid)
    layer.keep_moved(full_k, full_v, cand_ids.gather(1, decision.full), num_aged)
    owner.count_moves(decision, n_quant, n_full)
    if old is not None:
        layer.record_move(old, aged_ids)
    owner.scorer.carry(layer.scores)


def _promoted(layer, full_k: torch.Tensor, full_v: torch.Tensor, decision, n_quant: int):
    """The new full tier (B, H, K_f·Ω, D) with the windows each row promotes dequantized (the keys held no
    low-bit tier, so only they need full precision): every row dequantizes its own K_f slots, the promoted ones
    taken (a bound the host knows; with sizing on the host, nothing when no row promotes)."""
    promoted = decision.full < n_quant  # (B, K_f)
    if not promoted.shape[1] or layer.owner.backend.sizes_moves_on_host and not bool(promoted.any()):
        return full_k, full_v
    b, h, _, d = full_k.shape
    windows = layer.quant.select(decision.full.clamp(max=n_quant - 1), flat=layer.owner.backend.gathers_by_flat_index)
    none = full_k[:, :, :0]
    deq_k, deq_v = layer.with_quantized([none], [none], windows)  # (B, H, K_f·Ω, D)
    mask = promoted[:, None, :, None, None]  # (B, 1, K_f, 1, 1): by window
    by_window = (b, h, promoted.shape[1], -1, d)  # (B, H, K_f, Ω, D)
    return (torch.where(mask, deq_k.view(by_window), full_k.view(by_window)).view(b, h, -1, d),
            torch.where(mask, deq_v.view(by_window), full_v.view(by_window)).view(b, h, -1, d))


def _token_index(starts: torch.Tensor, cand_idx: torch.Tensor, omega: int) -> torch.Tensor:
    """(B, m) candidate indices -> (B, m*Ω) token indices into the attended keys."""
    return (starts[cand_idx].unsqueeze(-1) + torch.arange(omega, device=starts.device)).flatten(-2)
