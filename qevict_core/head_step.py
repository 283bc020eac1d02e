"""One decode step of every KV head of a layer at once: ``qevict_head`` on the CPU kernel.

qevict_head keeps each KV head's tiers apart (head_cache.py). Stepping them head by head runs QEvict's decode step H
times per layer, each a few dozen small tensor operations, which made its step 1.36x QEvict's at 4K tokens
(bench/README.md, "Head-adaptive routing"). Here one pass serves the layer: the heads' full-precision keys [sinks |
full | recent] are laid side by side in a padded (H, F, D) workspace, their quantized tiers (packed head after head
in one ledger, ``HeadwiseLayer.packed_quant``) are read in place by one varlen kernel call
(``cpu_decode.quant_logits_varlen``), one softmax runs over the padded rows (padding sits at -inf
and weighs nothing), and one scatter folds every head's window mass into the layer's stacked (H, W) score table. The
math is the per-head step's (``cpu_path``); only the order of float sums may differ.
"""

from __future__ import annotations

import torch

from kernels import cpu_decode


def attend(layer, query: torch.Tensor, scaling: float):
    """query (1, Hq, 1, D) of a decode step of ``layer`` (a HeadwiseLayer whose heads hold this step's token).
    -> out (1, 1, Hq, D) in the query dtype; keys, values (H, F, D), head h's [sinks | full | recent] in its first
    rows (the workspace that routing reads, head_move.py)."""
    heads, owner = layer.heads, layer.owner
    omega, sinks = owner.config.omega, heads[0].sink_k.shape[2]
    h, g, d = len(heads), query.shape[1] // len(heads), query.shape[-1]
    lens = [sinks + head.full_k.shape[2] + head.recent_k.shape[2] for head in heads]
    width = sinks + -(-(max(lens) - sinks) // omega) * omega  # whole windows after the sinks, for the window sums
    # (H, 1, F, D): a head per row. Padded keys may hold anything (their logits are masked), padded values must
    # be finite: they meet probabilities of exactly 0.
    keys, values = query.new_empty(h, 1, width, d), query.new_zeros(h, 1, width, d)
    for i, (head, n) in enumerate(zip(heads, lens)):
        torch.cat([head.sink_k, head.full_k, head.recent_k], dim=2, out=keys[i:i + 1, :, :n])
        torch.cat([head.sink_v, head.full_v, head.recent_v], dim=2, out=values[i:i + 1, :, :n])
    keys, values = keys.view(h, width, d), values.view(h, width, d)  # (H, F, D)
    rows = query.float().reshape(h, g, d)  # (H, G, D): KV head h's group of query heads, one query each
    logits = torch.bmm(rows, keys.transpose(1, 2)).mul_(scaling)  # (H, G, F)
    padded = torch.arange(width) >= torch.tensor(lens).unsqueeze(1)  # (H, F): one mask, not a slice per head
    logits.masked_fill_(padded.unsqueeze(1), float("-inf"))
    packed = layer.packed_quant()
    lengths = [head.quant.num_windows * omega for head in heads]
    n_quant = max(lengths)
    if n_quant:  # [quantized | full precision] per head, each part padded to the layer's longest
        cos, sin = owner.rope_table(keys)
        quant = cpu_decode.quant_logits_varlen(rows, packed.k_codes, packed.k_scale, packed.k_zero, packed.ids,
                                               lengths, cos, sin, owner.config.sinks, omega, owner.config.bits,
                                               scaling, width=n_quant)
        logits = torch.cat([quant, logits], dim=-1)
    probs = torch.softmax(logits, dim=-1)  # (H, G, Q + F)
    out = torch.bmm(probs[..., n_quant:], values)  # (H, G, D)
    if n_quant:
        out += cpu_decode.quant_values_varlen(probs, packed.v_codes, packed.v_scale, packed.v_zero, lengths,
                                              owner.config.bits)
    owner.note_workspace(keys.nbytes + values.nbytes + logits.nbytes + probs.nbytes)
    if owner.scorer.needs_attention:
        fold(layer, probs.sum(dim=1), n_quant, sinks, g)
    return out.reshape(1, 1, h * g, d).to(query.dtype), keys, values


def fold(layer, mass: torch.Tensor, n_quant: int, sinks: int, q_heads: int) -> None:
    """mass (H, Q + F): each key's attention mass in the padded layout of :func:`attend` -> the stacked score
    table, Eq. 1 averaged over each head's ``q_heads`` query heads. Padded keys carry no mass, so their window slots
    may name any window: they name window 0 and add zero to it."""
    heads, owner = layer.heads, layer.owner
    h, omega = len(heads), owner.config.omega
    quant_slots = n_quant // omega
    # Window sums of the two runs of whole windows, each a view of its rows: the sinks between them belong to none.
    per_window = torch.cat([mass[:, :n_quant].view(h, quant_slots, omega).sum(dim=2),
                            mass[:, n_quant + sinks:].view(h, -1, omega).sum(dim=2)], dim=1).div_(q_heads)
    first_recent = (heads[0].recent_start - owner.config.sinks) // omega
    recent = torch.arange(first_recent, first_recent + -(-heads[0].recent_k.shape[2] // omega),
                          dtype=torch.int32).unsqueeze(0)  # the same windows in every head
    slots = per_window.shape[1]
    zeros = torch.zeros(1, slots, dtype=torch.int32)
    parts = []  # (1, H·slots): every head's [quantized | padding | full | recent | padding], in one copy
    for head in heads:
        nq, nf = head.quant.num_windows, head.full_ids.shape[1]
        parts += [head.quant.ids, zeros[:, :quant_slots - nq], head.full_ids, recent,
                  zeros[:, :slots - quant_slots - nf - recent.shape[1]]]
    ids = torch.cat(parts, dim=1).view(h, slots)
    owner.scorer.fold(layer.scores, layer.interval, ids.long(), per_window)
