"""One routing move for every KV head of a layer at once: ``qevict_head`` on the CPU kernel.

A head's move (``row_move.move_rows``) is a fixed few dozen small tensor operations whatever its tiers hold, so
moving a layer's H heads one by one cost about twice QEvict's move of the whole layer (line profile in commit
87bc335's message). Here the heads move together: ``allot``'s one stable ranking gives every head's tiers (padding
at -inf sorts last, so each row is the head's own decision), and every head's candidates, laid end to end in one row
in the order of their records, make one move (move.py, the move of a row layer's batch rows): one index gathers
every full-precision window from the step's padded workspace, one call quantizes every window that enters a low-bit
tier without a record, and one join and one selection per tier build every head's ledger. Each head's new tiers
are contiguous views of the layer's tensors, head after head: the varlen kernel reads them in place, and together
they are exactly the layer's storage, so the byte count is unchanged.

The decisions and the stored tiers are the head-by-head move's, bit for bit (the same stable rankings, the same
per-window quantization; tests compare both), except the contents of dormant slots flagged invalid, which nothing
reads. Every head moves at once, so the layer's old and new tiers coexist during the move, as in QEvict's own move;
between the events the layer holds its H heads at their allotted K_f and K_q, within the budget.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from ..events import RoutingEvent
from .move import Candidates, move
from .routing import RoutingDecision, decide


def move_heads(layer, keys: torch.Tensor, values: torch.Tensor, cands: list[torch.Tensor], rank: torch.Tensor,
               ranked: torch.Tensor) -> None:
    """keys, values (H, F, D): the padded workspace of the CPU backend's ``step_heads``, head h's [sinks | full |
    recent] in its first rows; cands[h] (C_h,): head h's candidates [quantized | full | aged]; rank (H, C): their
    ranks, padded with -inf; ranked (H, C): ``allot``'s stable descending sort of the ranks eligible for the full
    tier, which set every head's ``allotted`` (K_f, K_q)."""
    heads, owner = layer.heads, layer.owner
    sinks, omega = owner.grid.sinks, owner.grid.omega
    h, width, d = keys.shape
    c = rank.shape[1]
    n_quant = [head.quant.num_windows for head in heads]
    n_full = [head.full_ids.shape[1] for head in heads]
    sizes = [x.numel() for x in cands]
    num_aged = sizes[0] - n_quant[0] - n_full[0]  # the same windows leave every head's recent region
    promotion = owner.config.promotion
    kf = [min(head.allotted[0], n if promotion else n - q) for head, n, q in zip(heads, sizes, n_quant)]
    kq = [min(head.allotted[1], n - k) for head, n, k in zip(heads, sizes, kf)]

    # The decision of per-layer routing (routing.decide), one row per head over the ranking allot already sorted.
    full, quant = decide(rank, None, torch.tensor(kf).unsqueeze(1), torch.tensor(kq).unsqueeze(1), order=ranked)

    # Every head's candidates in one row, [every head's quantized | every head's full | every head's aged] (head
    # after head in each part): the order of the records [the packed low-bit tier | each head's dormant ledger], so
    # a candidate's record is the record of its own index, as in a row layer's move. ``at`` (H, C): where head h's
    # slot lands in that row.
    nq, nf = torch.tensor(n_quant).unsqueeze(1), torch.tensor(n_full).unsqueeze(1)  # (H, 1)
    row, slot = torch.arange(h).unsqueeze(1), torch.arange(c)
    total_q, total_f = sum(n_quant), sum(n_full)
    at = torch.where(slot < nq, nq.cumsum(0) - nq + slot,
                     torch.where(slot < nq + nf, total_q + nf.cumsum(0) - nf + slot - nq,
                                 total_q + total_f + row * num_aged + slot - nq - nf))
    parts = [[x[:q] for x, q in zip(cands, n_quant)], [x[q:q + f] for x, q, f in zip(cands, n_quant, n_full)],
             [x[q + f:] for x, q, f in zip(cands, n_quant, n_full)]]
    ids = torch.cat([x for part in parts for x in part]).unsqueeze(0)  # (1, ΣC)
    # Where each candidate's tokens start in the flat workspace (a quantized one's nowhere: promotion dequantizes)
    in_fp = [torch.arange(f + num_aged) * omega + sinks + i * width for i, f in enumerate(n_full)]
    starts = torch.cat([torch.zeros(total_q, dtype=torch.long), *(x[:f] for x, f in zip(in_fp, n_full)),
                        *(x[f:] for x, f in zip(in_fp, n_full))])
    dormant = heads[0].dormant is not None
    has_record = torch.cat([torch.ones(total_q, dtype=torch.bool),
                            torch.cat([head.dormant_valid[0] for head in heads]) if dormant
                            else torch.zeros(total_f, dtype=torch.bool),
                            torch.zeros(h * num_aged, dtype=torch.bool)]).unsqueeze(0)
    records = [layer.packed_quant()] + ([head.dormant for head in heads] if dormant else [])

    # Each tier's windows, head after head, each head's in window-id order (as route_windows returns a row's).
    padded = pad_sequence(cands, batch_first=True, padding_value=torch.iinfo(torch.int32).max)  # padding sorts last
    by_id = padded.argsort(dim=1)
    in_order = at.gather(1, by_id)
    decision = RoutingDecision(in_order[full.gather(1, by_id)].unsqueeze(0),
                               in_order[quant.gather(1, by_id)].unsqueeze(0), sum(sizes))  # (1, ΣK_f), (1, ΣK_q)
    flat_keys, flat_values = keys.view(1, 1, h * width, d), values.view(1, 1, h * width, d)  # (B, H, T, D), B = H = 1
    moved = move(owner, flat_keys, flat_values, Candidates(ids, has_record, records, starts, total_q, False, dormant),
                 decision)

    record = owner.config.record_events  # copies of the old ids: a move rewrites them in place
    old = [(head.full_ids.clone(), head.quant.ids.clone()) for head in heads] if record else None
    stored = owner.shape.dtype  # the workspace may be in the model's dtype
    tokens_f = [k * omega for k in kf]
    layer.set_packed(moved.records.select(moved.quant), kq)
    for head, fk, fv, fi in zip(heads, moved.full_k.to(stored).split(tokens_f, dim=2),
                                moved.full_v.to(stored).split(tokens_f, dim=2), moved.full_ids.split(kf, dim=1)):
        head.keep_moved(fk, fv, fi, num_aged)
    if dormant:  # a promoted window's record stays as its dormant copy
        ledgers = moved.records.select(moved.dormant).split(kf)
        for head, ledger, flags in zip(heads, ledgers, moved.dormant_valid.split(kf, dim=1)):
            head.keep_records(head.quant, ledger, flags)
    owner.count_moves(decision, total_q, total_f)
    if old is not None:
        aged = cands[0][len(cands[0]) - num_aged:].tolist()
        owner.events.extend(RoutingEvent.after_move(head, o, aged) for head, o in zip(heads, old))
    owner.scorer.carry(layer.scores)  # the stacked table: every head's row at once
    owner.note_bytes(layer.layer_idx)
