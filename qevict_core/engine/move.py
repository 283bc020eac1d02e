"""One routing move (Algorithm 1, lines 5-21), for rows of candidates whatever a row is: a layer's batch rows
(row_move.py), every layer's rows at once (layer_stack.py) or every KV head of a per-head layer laid end to end in one
row (head_move.py).

A row's candidates come in the order [quantized | full | aged], and candidate c's record, where it has one, is
record c of the join of the move's records [quantized tier | dormant ledger (aligned with the full tier)]: a
quantized window's own, a full window's dormant copy. The decision (``routing.py``) names the candidates each tier
takes. The move gathers the full tier's tokens from the keys it is given, dequantizes the windows it promotes where
those keys lack them, quantizes (once, ever) the windows entering the low-bit tier without a record, and joins every
record in one copy, from which the low-bit tier and the dormant ledger each take their windows by one selection.
It returns the new tiers (``Moved``) and changes no layer: the caller keeps them in its own storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .assemble import assemble
from .layout import gather_seq
from .ledger import WindowLedger
from .rope import unrotate
from .routing import RoutingDecision


@dataclass
class Candidates:
    """What a move ranks and reads, per row.

    ids         (R, C) int32 window ids, [quantized | full | aged]
    has_record  (R, C) bool: candidate c's record is record c of ``records``' join
    records     [quantized tier, dormant ledger(s) aligned with the full tier], R rows each
    starts      (C,) where each candidate's first token lies in the keys of the move (a quantized candidate's only
                where ``tier_in_keys``: else the move dequantizes the ones it promotes from their records)
    n_quant     the quantized candidates in each row; keeps_dormant: whether the new tiers include a dormant ledger
    """

    ids: torch.Tensor
    has_record: torch.Tensor
    records: list[WindowLedger]
    starts: torch.Tensor
    n_quant: int
    tier_in_keys: bool
    keeps_dormant: bool


@dataclass
class Moved:
    """A move's new tiers: the full tier's tokens (R, H, K_f·Ω, D) and ids (R, K_f); the low-bit tier and the
    dormant ledger as slots (R, K_q) and (R, K_f) of ``records`` (the join), with the dormant slots' flags (R, K_f)
    (None without a dormant ledger)."""

    full_k: torch.Tensor
    full_v: torch.Tensor
    full_ids: torch.Tensor
    records: WindowLedger
    quant: torch.Tensor
    dormant: torch.Tensor | None
    dormant_valid: torch.Tensor | None


def move(owner, keys: torch.Tensor, values: torch.Tensor, cands: Candidates, decision: RoutingDecision) -> Moved:
    """``keys``/``values`` (R, H, T, D): the tokens ``cands.starts`` point into; ``decision`` over ``cands``."""
    omega, backend = owner.grid.omega, owner.backend
    flat = backend.gathers_by_flat_index
    full_tok = _token_index(cands.starts, decision.full, omega)
    full_k, full_v = gather_seq(keys, full_tok, flat=flat), gather_seq(values, full_tok, flat=flat)
    if not cands.tier_in_keys and cands.n_quant:
        full_k, full_v = _promoted(owner, keys, cands, full_k, full_v, decision.full)

    # Records quantized now for the low-bit tier's windows that have none (aged windows; demoted ones without a
    # dormant record), joined after the others in one copy.
    records = list(cands.records)
    n_records = sum(r.num_windows for r in records)
    quant_idx = decision.quant
    need = ~cands.has_record.gather(1, decision.quant)
    on_host = backend.sizes_moves_on_host  # else the scales' check is read back later
    if on_host:
        m = int(need.sum(1).max()) if need.any() else 0
    else:  # an aged window or a full one without a dormant record: a bound the host knows
        m = min(decision.quant.shape[1], cands.ids.shape[1] - cands.n_quant)
    if m:
        slots = need.int().argsort(dim=1, descending=True, stable=True)[:, :m]  # the windows that need one first
        chosen, needed = decision.quant.gather(1, slots), need.gather(1, slots)
        tok = _token_index(cands.starts, chosen, omega)
        positions = owner.grid.positions(cands.ids.gather(1, chosen))
        pre_rope = unrotate(gather_seq(keys, tok, flat=flat), *owner.cos_sin(keys, positions))
        fresh, unfit = WindowLedger.quantize_on(backend, pre_rope, gather_seq(values, tok, flat=flat),
                                                cands.ids.gather(1, chosen), omega, owner.config.bits,
                                                owner.config.param_dtype(owner.shape.dtype), check=on_host)
        if not on_host:
            owner.note_unfit(unfit & needed)
        records.append(fresh)
        fresh_idx = n_records + torch.arange(m, device=keys.device).expand_as(slots)
        quant_idx = quant_idx.scatter(1, slots, torch.where(needed, fresh_idx, chosen))
    joined = records[0].cat(*records[1:]) if len(records) > 1 else records[0]
    if joined.num_windows == 0:  # nothing quantized yet: every kept record is a placeholder, flagged invalid
        r, h, _, d = keys.shape
        joined = WindowLedger.empty(r, h, d, omega, owner.config.bits, joined.k_scale.dtype, keys.device, 1)
    last = joined.num_windows - 1  # candidates without a record read the last one (flagged invalid)
    dormant = cands.keeps_dormant
    return Moved(full_k, full_v, cands.ids.gather(1, decision.full), joined, quant_idx.clamp(max=last),
                 decision.full.clamp(max=last) if dormant else None,
                 cands.has_record.gather(1, decision.full) if dormant else None)


def _promoted(owner, keys: torch.Tensor, cands: Candidates, full_k: torch.Tensor, full_v: torch.Tensor,
              full: torch.Tensor):
    """The new full tier (R, H, K_f·Ω, D), in the keys' dtype, with the windows each row promotes dequantized from
    their records (the keys held no low-bit tier, so only they need full precision). Every row dequantizes m of its
    K_f slots: K_f (a bound the host knows), or where the host sizes moves, the most any row promotes (nothing when
    none does)."""
    promoted = full < cands.n_quant  # (R, K_f)
    k_f = promoted.shape[1]
    if owner.backend.sizes_moves_on_host:
        m = int(promoted.sum(1).max()) if k_f else 0
    else:
        m = k_f
    if not m:
        return full_k, full_v
    # the promoted slots first; all K_f slots in order when every one may be
    slots = promoted.to(torch.uint8).argsort(dim=1, descending=True, stable=True)[:, :m] if m < k_f else None
    picked, mask = (full, promoted) if slots is None else (full.gather(1, slots), promoted.gather(1, slots))
    windows = cands.records[0].select(picked.clamp(max=cands.n_quant - 1), flat=owner.backend.gathers_by_flat_index)
    none = full_k[:, :, :0]
    cos, signed_sin = owner.tier_rope(keys, windows.ids)
    deq_k, deq_v = assemble(windows, [none], [none], cos, signed_sin, dtype=owner.compute_dtype)  # (R, H, m·Ω, D)
    owner.note_workspace(deq_k.nbytes + deq_v.nbytes)
    r, h, _, d = full_k.shape
    by_window = (r, h, m, -1, d)  # (R, H, m, Ω, D)
    mask = mask[:, None, :, None, None]  # (R, 1, m, 1, 1): by window
    if slots is None:  # in the keys' dtype: a no-op where the tier computes in it (a GPU's 16-bit model)
        return tuple(torch.where(mask, deq.view(by_window), tier.view(by_window)).view(r, h, -1, d).to(tier.dtype)
                     for tier, deq in ((full_k, deq_k), (full_v, deq_v)))
    index = slots[:, None, :, None, None].expand(r, h, m, full_k.shape[2] // k_f, d)
    for tier, deq in ((full_k, deq_k), (full_v, deq_v)):
        windows_of = tier.view(r, h, k_f, -1, d)  # (R, H, K_f, Ω, D): the gather's copy, so written in place
        kept = windows_of.gather(2, index)
        windows_of.scatter_(2, index, torch.where(mask, deq.view(by_window), kept).to(tier.dtype))
    return full_k, full_v


def _token_index(starts: torch.Tensor, cand_idx: torch.Tensor, omega: int) -> torch.Tensor:
    """(R, m) candidate indices -> (R, m·Ω) token indices into the keys of the move."""
    return (starts[cand_idx].unsqueeze(-1) + torch.arange(omega, device=starts.device)).flatten(-2)
