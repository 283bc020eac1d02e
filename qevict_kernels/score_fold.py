"""A decode step's attention mass folded into a score table, per window, in one launch.

After the fused path's merge, each low-bit window's mass is known (``lowbit_attention.merge``) and each
full-precision key's is exp(logit - lse) over the step's rows. Eq. 1's table adds, per window, that mass summed
over the KV heads, the rows and the window's Ω keys, divided by the number of query heads. In PyTorch that is a
dozen small operators per layer and step (the exponentials, three sums, a pad, a concatenation, the windows' ids
built from the tiers and the recent region's device origin, a scatter); here one program per batch row does it,
the full-precision keys a tile of windows at a time (window ids are distinct, so each tile is one masked store).

Layout of the full-precision keys: [sinks | full tier (nF windows, ids ``full_ids``) | recent region], the recent
region's windows numbered from ``(origin + full_tokens) // Ω`` on (the buffer's slot j holds position origin + j).
Windows whose id is past the table's last carry no mass (the buffer's unwritten tail) and are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lowbit_attention import _live


@triton.jit
def _fold_kernel(table_ptr, win_mass_ptr, count_ptr, quant_ids_ptr, logits_ptr, lse_ptr, full_ids_ptr, origin_ptr,
                 cap, n, n_full, sinks, full_tokens, num_windows, inv_heads, HKV: tl.constexpr, R: tl.constexpr,
                 BLOCK_R: tl.constexpr, OMEGA: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    count = _live(count_ptr, b, cap)
    for first in range(0, cap, BLOCK_W):  # the low-bit windows: their mass summed over the KV heads
        win = first + tl.arange(0, BLOCK_W)
        live = win < count
        mass = tl.zeros([BLOCK_W], tl.float32)
        for h in tl.static_range(HKV):
            mass += tl.load(win_mass_ptr + (b * HKV + h) * cap + win, mask=live, other=0.0)
        ids = tl.load(quant_ids_ptr + b * cap + win, mask=live, other=0)
        old = tl.load(table_ptr + b * num_windows + ids, mask=live, other=0.0)
        tl.store(table_ptr + b * num_windows + ids, old + mass * inv_heads, mask=live)
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    slot = tl.arange(0, BLOCK_K)
    tok_in = tl.arange(0, BLOCK_K * OMEGA)  # BLOCK_K windows' keys, window-major
    first_recent = (tl.load(origin_ptr) + full_tokens) // OMEGA
    windows = (n - sinks + OMEGA - 1) // OMEGA
    for first in range(0, windows, BLOCK_K):  # the full-precision windows after the sinks, BLOCK_K at a time
        tok = sinks + first * OMEGA + tok_in
        tmask = tok < n
        per_key = tl.zeros([BLOCK_K * OMEGA], tl.float32)
        for h in tl.static_range(HKV):
            bh = b * HKV + h
            lse = tl.load(lse_ptr + bh * R + rows, mask=rmask, other=0.0)
            logit = tl.load(logits_ptr + (bh * R + rows)[:, None] * n + tok[None, :],
                            mask=rmask[:, None] & tmask[None, :], other=float("-inf"))
            per_key += tl.sum(tl.exp(logit - lse[:, None]), axis=0)
        mass = tl.sum(tl.reshape(per_key, (BLOCK_K, OMEGA)), axis=1)
        k = first + slot
        full = k < n_full
        wid = tl.where(full, tl.load(full_ids_ptr + b * n_full + k, mask=full, other=0).to(tl.int64),
                       first_recent + (k - n_full))
        keep = (k < windows) & (wid < num_windows)  # distinct windows: one store each
        old = tl.load(table_ptr + b * num_windows + wid, mask=keep, other=0.0)
        tl.store(table_ptr + b * num_windows + wid, old + mass * inv_heads, mask=keep)


def fold_step_mass(table: torch.Tensor, win_mass: torch.Tensor, count: torch.Tensor | None, quant_ids: torch.Tensor,
                   logits: torch.Tensor, lse: torch.Tensor, full_ids: torch.Tensor, origin: torch.Tensor, sinks: int,
                   full_tokens: int, omega: int, q_heads: int) -> None:
    """table (B, W) float32 += this step's mass per window / ``q_heads``, in place. win_mass (B, Hkv, cap): each
    low-bit window's mass summed over its group's rows, the first ``count[b]`` live (None: all), ids ``quant_ids``
    (B, cap);
    logits (B, Hkv, R, n): the step's masked logits of the full-precision keys, lse (B, Hkv, R) the merged
    log-sum-exp; full_ids (B, nF) int32; origin (1,) int64: the recent region's device origin; ``full_tokens`` =
    nF·Ω."""
    b, hkv, r, n = logits.shape
    cap = win_mass.shape[2]
    _fold_kernel[(b,)](table, win_mass.contiguous(), count, quant_ids.contiguous(), logits.contiguous(),
                       lse.contiguous(), full_ids.contiguous(), origin, cap, n, full_ids.shape[1], sinks,
                       full_tokens, table.shape[1], 1.0 / q_heads, HKV=hkv, R=r,
                       BLOCK_R=max(16, triton.next_power_of_2(r)), OMEGA=omega, BLOCK_W=64,
                       BLOCK_K=max(1, 64 // omega))


def fold_step_mass_reference(table: torch.Tensor, win_mass: torch.Tensor, count: torch.Tensor,
                             quant_ids: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, full_ids: torch.Tensor,
                             origin: torch.Tensor, sinks: int, full_tokens: int, omega: int, q_heads: int) -> None:
    """The same fold in PyTorch, as the engine's layer does it (``QEvictLayer.fold_windows``)."""
    b, num_windows = table.shape
    for row in range(b):
        live = int(count[row])
        table[row].index_add_(0, quant_ids[row, :live].long(), win_mass[row, :, :live].sum(0) / q_heads)
        per_key = torch.exp(logits[row] - lse[row].unsqueeze(-1)).sum(dim=(0, 1))[sinks:]  # (n - sinks,)
        per_key = torch.nn.functional.pad(per_key, (0, -per_key.shape[0] % omega))
        per_window = per_key.reshape(-1, omega).sum(1) / q_heads
        first = int((origin[0] + full_tokens) // omega)
        ids = torch.cat([full_ids[row].long(), first + torch.arange(per_window.shape[0] - full_ids.shape[1])])
        kept = ids < num_windows
        table[row].index_add_(0, ids[kept], per_window[kept])
