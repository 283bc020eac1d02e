"""QEvict's decode step on the CPU with the low-bit tier read in place (``qevict_kernels.cpu_decode``).

The PyTorch path rebuilds the quantized tier in full precision before every step (``assemble.py``): at 4K tokens
that rebuild was most of QEvict's step on one core. Here ``update`` returns only the full-precision keys
(sinks | full | recent), and attention runs as one softmax over [quantized | full precision] logits: the quantized
logits come from the C kernel (dequantize, re-rotate and dot one key at a time), the full-precision ones from a
matmul, and the output is the C kernel's probability-weighted dequantized values plus a matmul over the rest.
The probabilities are also every key's attention mass: a decode step folds them into the layer's score table in C
(``cpu_decode.fold_varlen``, the per-head cache's fold, each batch row one table row), the PyTorch path's fold in
one call. Same math; only the order of float sums differs (tests compare logits and generated tokens).
"""

from __future__ import annotations

import torch

from qevict_kernels import cpu_decode


def attend(layer, query: torch.Tensor, fp_keys: torch.Tensor, fp_values: torch.Tensor,
           scaling: float, scored: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query (B, Hq, L, D); fp_keys/values (B, Hkv, n, D) [sinks | full | recent], whose last L keys are the
    queries' own tokens. -> out (B, L, Hq, D) in the query dtype, mass (B, Hkv, N) float32 over the keys
    [quantized | sinks | full | recent], or None: not ``scored``, or a decode step, which folds its mass itself."""
    b, hq, lq, d = query.shape
    hkv = fp_keys.shape[1]
    rows = query.float().reshape(b, hkv, hq // hkv * lq, d)  # (B, Hkv, G*L, D): head h reads KV head h // G
    quant, owner = layer.quant, layer.owner
    n_quant = quant.k_codes.shape[2]
    logits = torch.matmul(rows, fp_keys.float().transpose(2, 3)).mul_(scaling)  # (B, Hkv, G*L, n)
    if n_quant:  # [quantized | full precision], the order of the key positions
        cos, sin = owner.rope_table(fp_keys)
        quant_logits = cpu_decode.quant_logits(rows, quant.k_codes, quant.k_scale, quant.k_zero, quant.ids, cos, sin,
                                               owner.config.sinks, quant.omega, quant.bits, scaling)
        logits = torch.cat([quant_logits, logits], dim=-1)
    if lq > 1:  # only the queries' own tokens can be later than a query: the last L keys, bottom-right causal
        later = torch.ones(lq, lq, dtype=torch.bool, device=logits.device).triu_(1)
        logits.view(b, hkv, hq // hkv, lq, -1)[..., -lq:].masked_fill_(later, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs[..., n_quant:], fp_values.float())  # (B, Hkv, G*L, D)
    if n_quant:
        out += cpu_decode.quant_values(probs, quant.v_codes, quant.v_scale, quant.v_zero, quant.bits)
    owner.note_workspace(2 * probs.nbytes)
    out = out.view(b, hq, lq, d).transpose(1, 2).to(query.dtype)  # (B, L, Hq, D), as transformers expects
    if not scored:
        return out, None
    if lq == 1:  # a decode step: every window's mass straight into the score table, in C (no per-key mass)
        _fold(layer, probs.view(b, hq, -1), n_quant)
        return out, None
    return out, probs.view(b, hkv, hq // hkv, lq, -1).sum(dim=(2, 3))


def _fold(layer, probs: torch.Tensor, n_quant: int) -> None:
    """Eq. 1's fold of one decode step, probs (B, Hq, N) over [quantized | sinks | full | recent]: each batch row
    is one table row, its Hq query heads the rows the window mass is averaged over, as ``QEvictLayer.fold_windows``
    averages it (one C call, where the PyTorch fold took a dozen operators)."""
    owner = layer.owner
    cpu_decode.fold_varlen(probs, owner.scorer.mass_table(layer.scores, layer.interval), list(layer.quant.ids),
                           list(layer.full_ids), n_quant, layer.sink_k.shape[2],
                           layer.grid.window_of(layer.recent_start), layer.recent_k.shape[2], layer.grid.omega)
