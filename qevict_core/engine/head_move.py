"""One routing move for every KV head of a layer at once: ``qevict_head`` on the CPU kernel.

A head's move (``row_move.move_rows``) is a fixed few dozen small tensor operations whatever its tiers hold, so
moving a layer's H heads one by one cost about twice QEvict's move of the whole layer (line profile in commit
87bc335's message). Here the heads move together, as rows of padded tensors: ``allot``'s one stable ranking gives
every head's tiers (padding at -inf sorts last, so each row is the head's own decision), one index gathers every
full-precision window from the step's padded workspace, one call quantizes every window that enters a low-bit tier
without a record, and one join and one selection per tier build every head's ledger. Each head's new tiers are
contiguous views of the layer's tensors, head after head: the varlen kernel reads them in place, and together they
are exactly the layer's storage, so the byte count is unchanged.

The decisions and the stored tiers are the head-by-head move's, bit for bit (the same stable rankings, the same
per-window quantization; tests compare both), except the contents of dormant slots flagged invalid, which nothing
reads.
Every head moves at once, so the layer's old and new tiers coexist during the move, as in QEvict's own move;
between the events the layer holds its H heads at their allotted K_f and K_q, within the budget.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from .assemble import assemble
from ..events import RoutingEvent
from .ledger import WindowLedger
from .rope import unrotate
from .routing import decide


def move_heads(layer, keys: torch.Tensor, values: torch.Tensor, cands: list[torch.Tensor], rank: torch.Tensor,
               ranked: torch.Tensor) -> None:
    """keys, values (H, F, D): the padded workspace of the CPU backend's ``step_heads``, head h's [sinks | full | recent] in its
    first rows; cands[h] (C_h,): head h's candidates [quantized | full | aged]; rank (H, C): their ranks, padded
    with -inf; ranked (H, C): ``allot``'s stable descending sort of the ranks eligible for the full tier, which set
    every head's ``allotted`` (K_f, K_q)."""
    heads, owner = layer.heads, layer.owner
    grid, promotion = owner.grid, owner.config.promotion
    sinks, omega = grid.sinks, grid.omega
    h, width, d = keys.shape
    c = rank.shape[1]
    n_quant = [head.quant.num_windows for head in heads]
    n_full = [head.full_ids.shape[1] for head in heads]
    nq, nf = torch.tensor(n_quant).unsqueeze(1), torch.tensor(n_full).unsqueeze(1)  # (H, 1)
    sizes = [x.numel() for x in cands]
    num_aged = sizes[0] - n_quant[0] - n_full[0]  # the same windows leave every head's recent region
    kf = [min(head.allotted[0], n if promotion else n - q) for head, n, q in zip(heads, sizes, n_quant)]
    kq = [min(head.allotted[1], n - k) for head, n, k in zip(heads, sizes, kf)]

    # The decision of per-layer routing (routing.decide), one row per head over the ranking allot already sorted.
    slot = torch.arange(c)
    full, quant = decide(rank, None, torch.tensor(kf).unsqueeze(1), torch.tensor(kq).unsqueeze(1), order=ranked)

    # Every candidate's record in the layer's join [each head's quantized | each head's dormant | fresh] (-1: none),
    # tier (0 quantized, 1 full, 2 aged) and, for a full or aged one, where it starts in the flat workspace.
    row = torch.arange(h).unsqueeze(1)
    record = torch.where(slot < nq, nq.cumsum(0) - nq + slot, -1)  # (H, C)
    parts = [layer.packed_quant()]  # every head's quantized tier, head after head
    n_records = sum(n_quant)
    if heads[0].dormant is not None:
        parts += [head.dormant for head in heads]
        valid = torch.cat([head.dormant_valid[0] for head in heads])  # (ΣF,) aligned with the joined dormants
        if valid.numel():
            at = nf.cumsum(0) - nf + slot - nq  # the dormant slot of a full-tier candidate
            has = (slot >= nq) & (slot < nq + nf) & valid[at.clamp(0, valid.numel() - 1)]
            record = torch.where(has, n_records + at, record)
        n_records += sum(n_full)
    tier = (slot >= nq).long() + (slot >= nq + nf).long()
    start = row * width + sinks + (slot - nq) * omega
    ids = pad_sequence(cands, batch_first=True, padding_value=torch.iinfo(torch.int32).max)  # padding sorts last
    by_id = ids.argsort(dim=1)  # each head's chosen windows in window-id order, as route_windows returns them
    flat = by_id + row * c
    attrs = torch.stack([record, tier, start, ids.long()]).view(4, h * c)
    f_rec, f_tier, f_start, f_ids = attrs.index_select(1, flat[full.gather(1, by_id)])  # (ΣK_f,) each, head-major
    q_rec, q_tier, q_start, q_ids = attrs.index_select(1, flat[quant.gather(1, by_id)])

    # Windows entering a low-bit tier without a record are quantized now, from the workspace (never promoted ones).
    ws_keys, ws_values = keys.view(1, 1, h * width, d), values.view(1, 1, h * width, d)  # (B, H, T, D), B = H = 1
    need = q_rec < 0
    n_fresh = int(need.sum())
    if n_fresh:
        tok = _tokens(q_start[need], omega)
        fresh_ids = q_ids[need].unsqueeze(0)
        positions = grid.positions(fresh_ids)
        pre_rope = unrotate(ws_keys.index_select(2, tok), *owner.cos_sin(ws_keys, positions))
        parts.append(WindowLedger.quantize_on(owner.backend, pre_rope, ws_values.index_select(2, tok), fresh_ids,
                                              omega, owner.config.bits, owner.config.param_dtype(owner.shape.dtype),
                                              check=True)[0])
        q_rec = q_rec.masked_scatter(need, n_records + torch.arange(n_fresh))
    parts = [p for p in parts if p.num_windows]
    joined = parts[0].cat(*parts[1:]) if parts else None

    # Full tiers: promoted windows dequantized in front of the workspace, then one gather of every head's windows.
    promoted = f_tier == 0
    n_promoted = int(promoted.sum())
    source_k, source_v = ws_keys, ws_values
    if n_promoted:
        windows = joined.select(f_rec[promoted].unsqueeze(0))
        cos, signed_sin = owner.tier_rope(ws_keys, windows.ids)
        source_k, source_v = assemble(windows, [ws_keys], [ws_values], cos, signed_sin, dtype=owner.compute_dtype)
        owner.note_workspace(source_k.nbytes + source_v.nbytes)
        f_start = torch.where(promoted, (promoted.cumsum(0) - 1) * omega, f_start + n_promoted * omega)
    tok = _tokens(f_start, omega)
    stored = owner.shape.dtype  # the workspace may be in the model's dtype
    full_k, full_v = source_k.index_select(2, tok).to(stored), source_v.index_select(2, tok).to(stored)
    if joined is None:
        joined = WindowLedger.empty(1, 1, d, omega, owner.config.bits, owner.config.param_dtype(stored),
                                    keys.device, 1)
    quant_ledger = joined.select(q_rec.unsqueeze(0))

    record = owner.config.record_events  # copies of the old ids: a move rewrites them in place
    old = [(head.full_ids.clone(), head.quant.ids.clone()) for head in heads] if record else None
    tokens_f = [k * omega for k in kf]
    layer.set_packed(quant_ledger, kq)
    for head, fk, fv, fi in zip(heads, full_k.split(tokens_f, dim=2), full_v.split(tokens_f, dim=2),
                                f_ids.to(torch.int32).unsqueeze(0).split(kf, dim=1)):
        head.keep_moved(fk, fv, fi, num_aged)
    if heads[0].dormant is not None:  # a promoted window's record stays as its dormant copy
        dormant = joined.select(f_rec.clamp(min=0).unsqueeze(0))
        for head, ledger, flags in zip(heads, dormant.split(kf), (f_rec >= 0).unsqueeze(0).split(kf, dim=1)):
            head.keep_records(head.quant, ledger, flags)
    owner.add_moves(promoted.sum(), (q_tier == 1).sum(), sum(sizes) - f_rec.numel() - q_rec.numel())
    if old is not None:
        aged = cands[0][len(cands[0]) - num_aged:].tolist()
        owner.events.extend(RoutingEvent.after_move(head, o, aged) for head, o in zip(heads, old))
    owner.scorer.carry(layer.scores)  # the stacked table: every head's row at once
    owner.note_bytes(layer.layer_idx)


def _tokens(starts: torch.Tensor, omega: int) -> torch.Tensor:
    """(n,) window starts -> (n·Ω,) token indices, window-major."""
    return (starts.unsqueeze(1) + torch.arange(omega)).flatten()
