"""One decode step of every KV head of a layer at once: ``qevict_head`` on the CPU kernel.

qevict_head keeps each KV head's tiers apart (head_cache.py). Stepping them head by head runs QEvict's decode step H
times per layer, each a few dozen small tensor operations, which made its step 1.36x QEvict's at 4K tokens
(bench/README.md, "Head-adaptive routing"). Here one pass serves the layer: the heads' full-precision keys [sinks |
full | recent] are laid side by side in a padded (H, F, D) workspace, their quantized tiers (packed head after head
in one ledger, ``HeadwiseLayer.packed_quant``) are read in place by one varlen kernel call
(``cpu_decode.quant_logits_varlen``), one softmax runs over the padded rows (padding sits at -inf and weighs
nothing), and one C call (``cpu_decode.fold_varlen``) adds every head's window mass to its row of the layer's stacked
(H, W) score table. The math is the per-head step's (``cpu_path``); only the order of float sums may differ.
"""

from __future__ import annotations

import torch

from qevict_kernels import cpu_decode


def attend(layer, query: torch.Tensor, scaling: float):
    """query (1, Hq, 1, D) of a decode step of ``layer`` (a HeadwiseLayer whose heads hold this step's token).
    -> out (1, 1, Hq, D) in the query dtype; keys, values (H, F, D), head h's [sinks | full | recent] in its first
    rows (the workspace that routing reads, head_move.py)."""
    heads, owner = layer.heads, layer.owner
    omega, sinks = owner.config.omega, heads[0].sink_k.shape[2]
    h, g, d = len(heads), query.shape[1] // len(heads), query.shape[-1]
    lens = [sinks + head.full_k.shape[2] + head.recent_k.shape[2] for head in heads]
    width = sinks + -(-(max(lens) - sinks) // omega) * omega  # whole windows after the sinks, for the window sums
    # Every head's [sinks | full | recent | zeros] in one copy per tensor: (1, 1, H·F, D) viewed as (H, F, D). Padded
    # logits are masked; padded values must be finite, since they meet probabilities of exactly 0.
    pad = query.new_zeros(1, 1, width - min(lens), d, dtype=torch.float32)  # cat widens 16-bit tiers to it
    keys = torch.cat([t for head, n in zip(heads, lens) for t in (head.sink_k, head.full_k, head.recent_k,
                                                                  pad[:, :, :width - n])], dim=2).view(h, width, d)
    values = torch.cat([t for head, n in zip(heads, lens) for t in (head.sink_v, head.full_v, head.recent_v,
                                                                    pad[:, :, :width - n])], dim=2).view(h, width, d)
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
    if owner.scorer.needs_attention:  # every head's window mass into its row of the stacked table, in C
        cpu_decode.fold_varlen(probs, owner.scorer.mass_table(layer.scores, layer.interval),
                               [head.quant.ids for head in heads], [head.full_ids for head in heads], n_quant, sinks,
                               owner.grid.window_of(heads[0].recent_start), heads[0].recent_k.shape[2],
                               omega)
    return out.reshape(1, 1, h * g, d).to(query.dtype), keys, values
