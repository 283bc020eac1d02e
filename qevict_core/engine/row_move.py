"""QEvict's per-layer routing for a layer's batch rows (Algorithm 1): its settled candidates, the decision
(``decide_rows``) for one layer or for every layer of a forward at once, and the move (move.py) of its rows, kept in
the layer's own storage (``keep_selected``, ``keep_moved``).

The decision (``routing.route_windows``) ranks the candidates - the quantized tier, the full tier and the windows
aging out of the recent region. The move reads the keys it is given: a row layer's own full-precision buffer (its
event waits for the forward's end, cache.py), from which each row dequantizes the windows it promotes, or what a
forward attended over with the low-bit tier dequantized in front (a continuation's event, a head moving on its own,
on the PyTorch path), from which promotion copies the window. Every layer as rows of one move: layer_stack.py; every
KV head of a per-head layer at once: head_move.py.
"""

from __future__ import annotations

import torch

from .move import Candidates, move
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
    owner = layer.owner
    n_quant, n_full = layer.quant.num_windows, layer.full_ids.shape[1]
    aged_ids = cand_ids[:, n_quant + n_full:]
    # copies: a move rewrites the tiers in place
    old = (layer.full_ids.clone(), layer.quant.ids.clone()) if owner.config.record_events else None
    moved = move(owner, keys, values, row_candidates(layer, keys, cand_ids), decision)
    layer.keep_selected(moved.records, moved.quant, moved.dormant,
                        layer.dormant_valid if moved.dormant_valid is None else moved.dormant_valid)
    layer.keep_moved(moved.full_k, moved.full_v, moved.full_ids, aged_ids.shape[1])
    owner.count_moves(decision, n_quant, n_full)
    if old is not None:
        layer.record_move(old, aged_ids)
    owner.scorer.carry(layer.scores)


def row_candidates(layer, keys: torch.Tensor, cand_ids: torch.Tensor) -> Candidates:
    """A row layer's candidates ``cand_ids`` (B, C) [quantized | full | aged] as a move reads them from ``keys``
    (``move_rows``'): candidate c's record is record c of [quantized | dormant (aligned with the full tier)]."""
    omega = layer.grid.omega
    n_quant, n_full = layer.quant.num_windows, layer.full_ids.shape[1]
    num_aged = cand_ids.shape[1] - n_quant - n_full
    has_record = torch.cat([torch.ones_like(layer.quant.ids, dtype=torch.bool),
                            layer.dormant_valid if layer.dormant is not None
                            else torch.zeros_like(layer.full_ids, dtype=torch.bool),
                            torch.zeros_like(cand_ids[:, n_quant + n_full:], dtype=torch.bool)], dim=1)
    # Where each candidate's tokens start in ``keys``: [quant | sinks | full | recent (aged first)]; without the
    # quantized tier in ``keys`` its candidates start nowhere (0: the move dequantizes the ones it promotes).
    fp_tokens = layer.fp.capacity if layer.reads_buffer else layer.fp.length  # what ``keys`` ends with
    tier_in_keys = keys.shape[2] > fp_tokens
    fp_start = keys.shape[2] - fp_tokens + layer.fp.sinks  # past [quant | sinks]
    quant_starts = torch.arange(n_quant, device=keys.device) * omega if tier_in_keys else \
        torch.zeros(n_quant, dtype=torch.long, device=keys.device)
    starts = torch.cat([quant_starts, fp_start + torch.arange(n_full + num_aged, device=keys.device) * omega])
    records = [layer.quant] + ([layer.dormant] if layer.dormant is not None else [])
    return Candidates(cand_ids, has_record, records, starts, n_quant, tier_in_keys, layer.dormant is not None)
