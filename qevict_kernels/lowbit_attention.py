"""Attention over the low-bit tier in one pass per key: split-K over windows, with each window's log-sum-exp.

One program handles one (batch row, KV head, split of the windows). Its query rows are the G query heads of the
group times the step's queries, so a key tile is decoded once for the whole group. For each tile of WB windows:

- the packed codes are loaded once: the bit-plane packing puts channel j and its RoPE partner j + D/2 in the same
  byte (INT4: the two nibbles; INT2: planes p and p + 2), so both halves of a key come from one load;
- the key scales and zero-points are loaded once per window and broadcast over its Ω tokens;
- RoPE is applied by angle addition: cos/sin of each window's first position (D/2 of each per window) combined
  with a (Ω, D/2) table of cos/sin(t·f), t < Ω, instead of a sine and a cosine per element;
- the dot products take half-precision operands (float16: exact for dequantized codes of scaled integers, and
  what the interpreter computes correctly) with float32 accumulation, softmax in base 2;
- the log-sum-exp of every window over its Ω keys is written beside the output, so the routing mass of window w,
  Σ_rows exp(lse_w - lse_row), needs no second read of the keys once the row's total is known (``merge``).

The live window count of each batch row is read from a device tensor and the grid is fixed at ``splits``
programs per (row, head), so the launch has the same shape whatever the tier holds (CUDA-graph capturable).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .packed import PackedWindows, window_positions

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _split_kernel(q_ptr, k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, ids_ptr,
                  count_ptr, inv_freq_ptr, step_cos_ptr, step_sin_ptr, out_ptr, lse_ptr, win_lse_ptr, rope_scale,
                  qk_scale, cap, windows_per_split, SPLITS: tl.constexpr, HKV: tl.constexpr, R: tl.constexpr,
                  BLOCK_R: tl.constexpr, SINKS: tl.constexpr, OMEGA: tl.constexpr, BITS: tl.constexpr,
                  D: tl.constexpr, WB: tl.constexpr, FAST_TRIG: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    HALF: tl.constexpr = D // 2
    ROW: tl.constexpr = D * BITS // 8  # bytes per token; code c in byte c % ROW, bit plane c // ROW
    BLOCK_N: tl.constexpr = WB * OMEGA
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    half = tl.arange(0, HALF)
    dims = tl.arange(0, D)
    # q (B, Hkv, R, D): both halves, in half precision for the dot products
    q_base = q_ptr + (bh * R + rows)[:, None] * D
    q_lo = tl.load(q_base + half[None, :], mask=rmask[:, None], other=0.0).to(tl.float16)
    q_hi = tl.load(q_base + HALF + half[None, :], mask=rmask[:, None], other=0.0).to(tl.float16)
    freq = tl.load(inv_freq_ptr + half)
    t = tl.arange(0, OMEGA)
    step_cos = tl.load(step_cos_ptr + t[:, None] * HALF + half[None, :])  # (Ω, D/2): cos(t·f)
    step_sin = tl.load(step_sin_ptr + t[:, None] * HALF + half[None, :])
    # the low half of channel j is bit plane j // ROW of byte j % ROW; its partner j + D/2 sits 4 bits higher
    lo_byte = half % ROW
    lo_shift = (half // ROW) * BITS
    v_byte = dims % ROW
    v_shift = (dims // ROW) * BITS

    count = _live(count_ptr, b, cap)
    start = split * windows_per_split
    stop = tl.minimum(start + windows_per_split, count)
    codes_base = bh * cap * OMEGA * ROW
    pair_base = bh * cap * D
    tok_base = bh * cap * OMEGA

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for first in range(start, stop, WB):
        win = first + tl.arange(0, WB)
        wmask = win < stop
        tok = first * OMEGA + tl.arange(0, BLOCK_N)
        tmask = tok < stop * OMEGA
        # codes, once: (BLOCK_N, D/2) bytes hold both halves of every key
        packed = tl.load(k_codes_ptr + codes_base + tok[:, None] * ROW + lo_byte[None, :], mask=tmask[:, None],
                         other=0).to(tl.int32)
        c_lo = ((packed >> lo_shift[None, :]) & MASK).to(tl.float32)
        c_hi = ((packed >> (lo_shift[None, :] + 4)) & MASK).to(tl.float32)
        # scales and zero-points, once per window: (WB, D/2) each half, broadcast over the window's Ω tokens
        pair = pair_base + win[:, None] * D + half[None, :]
        s_lo = tl.load(k_scale_ptr + pair, mask=wmask[:, None], other=0.0).to(tl.float32)
        z_lo = tl.load(k_zero_ptr + pair, mask=wmask[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(k_scale_ptr + pair + HALF, mask=wmask[:, None], other=0.0).to(tl.float32)
        z_hi = tl.load(k_zero_ptr + pair + HALF, mask=wmask[:, None], other=0.0).to(tl.float32)
        k_lo = c_lo * _per_token(s_lo, WB, OMEGA, HALF) + _per_token(z_lo, WB, OMEGA, HALF)
        k_hi = c_hi * _per_token(s_hi, WB, OMEGA, HALF) + _per_token(z_hi, WB, OMEGA, HALF)
        # RoPE by angle addition: the window's first position, then t·f from the table
        first_pos = SINKS + tl.load(ids_ptr + b * cap + win, mask=wmask, other=0) * OMEGA
        angle = first_pos.to(tl.float32)[:, None] * freq[None, :]  # (WB, D/2)
        base_cos, base_sin = _cos_sin(angle, FAST_TRIG)
        cos = tl.reshape(base_cos[:, None, :] * step_cos[None, :, :] - base_sin[:, None, :] * step_sin[None, :, :],
                         (BLOCK_N, HALF)) * rope_scale
        sin = tl.reshape(base_sin[:, None, :] * step_cos[None, :, :] + base_cos[:, None, :] * step_sin[None, :, :],
                         (BLOCK_N, HALF)) * rope_scale
        r_lo = (k_lo * cos - k_hi * sin).to(tl.float16)
        r_hi = (k_hi * cos + k_lo * sin).to(tl.float16)
        s = _dot_t(q_lo, r_lo, HALF) + _dot_t(q_hi, r_hi, HALF)  # (BLOCK_R, BLOCK_N) float32
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # base-2 logits
        # each window's log-sum-exp over its Ω keys (natural log), for the routing mass
        by_window = tl.reshape(s, (BLOCK_R, WB, OMEGA))
        w_max = tl.max(by_window, axis=2)
        w_safe = tl.where(w_max == float("-inf"), 0.0, w_max)
        w_sum = tl.sum(tl.exp2(by_window - w_safe[:, :, None]), axis=2)
        w_lse = tl.where(w_sum > 0, (w_safe + tl.log2(w_sum)) * 0.6931471805599453, float("-inf"))
        tl.store(win_lse_ptr + (bh * cap + win)[None, :] * R + rows[:, None], w_lse,
                 mask=rmask[:, None] & wmask[None, :])
        # online softmax, base 2
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        v_packed = tl.load(v_codes_ptr + codes_base + tok[:, None] * ROW + v_byte[None, :], mask=tmask[:, None],
                           other=0).to(tl.int32)
        v_scale = tl.load(v_scale_ptr + tok_base + tok, mask=tmask, other=0.0).to(tl.float32)
        v_zero = tl.load(v_zero_ptr + tok_base + tok, mask=tmask, other=0.0).to(tl.float32)
        values = ((v_packed >> v_shift[None, :]) & MASK).to(tl.float32) * v_scale[:, None] + v_zero[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), values.to(tl.float16))
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    _store_split(out_ptr, lse_ptr, (bh * SPLITS + split) * R + rows, rmask, dims, acc, l, m, D)
    # this split's windows past the live count: -inf, written here so the caller need not fill the table first
    # (one launch fewer per layer and step)
    end = tl.minimum(start + windows_per_split, cap)
    for first in range(tl.maximum(start, count), end, WB):
        win = first + tl.arange(0, WB)
        tl.store(win_lse_ptr + (bh * cap + win)[None, :] * R + rows[:, None],
                 tl.full([BLOCK_R, WB], float("-inf"), tl.float32), mask=rmask[:, None] & (win < end)[None, :])


@triton.jit
def _live(count_ptr, b, cap):
    """Row b's live windows: ``count[b]``, or with no count (the engine's tiers are always full) all ``cap``, so a
    step need not fill a count first."""
    if count_ptr is None:  # a constant: one branch compiled
        live = cap
    else:
        live = tl.load(count_ptr + b)
    return live


@triton.jit
def _store_split(out_ptr, lse_ptr, part, rmask, dims, acc, l, m, D: tl.constexpr):
    """A split's normalised output and natural log-sum-exp from its online softmax in base 2 (-inf for a split that
    saw no key) at rows ``part``: out (B, Hkv, S, R, D), lse (B, Hkv, S, R)."""
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + part[:, None] * D + dims[None, :], out, mask=rmask[:, None])
    tl.store(lse_ptr + part, lse, mask=rmask)


@triton.jit
def _cos_sin(angle, FAST: tl.constexpr):
    """cos and sin of float32 angles. FAST (compiled for CUDA): reduced to [-π, π] by Cody-Waite (2π split in a
    short exact part and a remainder) and taken by the hardware's approximations, whose error there is ~1e-6: no
    slow large-argument path, which needs a stack. Otherwise libdevice's (and the interpreter's) precise ones."""
    if FAST:
        k = tl.floor(angle * 0.15915494309189535 + 0.5)
        x = angle - k * 6.28125
        x = x - k * 0.0019353071795864769
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    return c, s


@triton.jit
def _dot_t(a, b, K: tl.constexpr):
    """a (M, K) · b (N, K)ᵀ in float32: tensor cores where K allows (tl.dot needs K >= 16), else by broadcast."""
    if K >= 16:
        return tl.dot(a, tl.trans(b))
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _per_token(x, WB: tl.constexpr, OMEGA: tl.constexpr, HALF: tl.constexpr):
    """(WB, HALF) per window -> (WB·Ω, HALF) per token, window-major."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (WB, OMEGA, HALF)), (WB * OMEGA, HALF))


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, fp_out_ptr, fp_lse_ptr, win_lse_ptr, ids_ptr, count_ptr, out_ptr,
                  lse_ptr, mass_ptr, cap, SPLITS: tl.constexpr, FP_SPLITS: tl.constexpr, HKV: tl.constexpr,
                  R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr):
    """One (batch row, KV head): the low-bit splits and the full-precision ones merged by log-sum-exp -> out (B, Hkv,
    R, D) in its tensor's dtype and lse (B, Hkv, R); then each live window's mass, Σ_rows exp(lse_w - lse), -> mass
    (B, Hkv, cap)."""
    bh = tl.program_id(0)
    b = bh // HKV
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    dims = tl.arange(0, D)
    total = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for split in range(FP_SPLITS):
        total = _log_add(total, tl.load(fp_lse_ptr + (bh * FP_SPLITS + split) * R + rows, mask=rmask,
                                        other=float("-inf")))
    for split in range(SPLITS):
        total = _log_add(total, tl.load(part_lse_ptr + (bh * SPLITS + split) * R + rows, mask=rmask,
                                        other=float("-inf")))
    safe_total = tl.where(total == float("-inf"), 0.0, total)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for split in range(FP_SPLITS):
        acc += _weighted(fp_out_ptr, fp_lse_ptr, (bh * FP_SPLITS + split) * R + rows, rmask, dims, safe_total, D)
    for split in range(SPLITS):
        acc += _weighted(part_out_ptr, part_lse_ptr, (bh * SPLITS + split) * R + rows, rmask, dims, safe_total, D)
    tl.store(out_ptr + (bh * R + rows)[:, None] * D + dims[None, :], acc, mask=rmask[:, None])
    tl.store(lse_ptr + bh * R + rows, total, mask=rmask)
    count = _live(count_ptr, b, cap)
    for first in range(0, cap, BLOCK_W):  # every slot written (0 past the live count): no fill before the launch
        win = first + tl.arange(0, BLOCK_W)
        wmask = win < count
        w_lse = tl.load(win_lse_ptr + (bh * cap + win)[None, :] * R + rows[:, None],
                        mask=rmask[:, None] & wmask[None, :], other=float("-inf"))
        mass = tl.sum(tl.exp(w_lse - safe_total[:, None]), axis=0)
        tl.store(mass_ptr + bh * cap + win, mass, mask=win < cap)


@triton.jit
def _log_add(total, other):
    """log(exp(total) + exp(other)), -inf where both are."""
    high = tl.maximum(total, other)
    safe = tl.where(high == float("-inf"), 0.0, high)
    both = tl.exp(total - safe) + tl.exp(other - safe)
    return tl.where(both > 0, safe + tl.log(tl.where(both > 0, both, 1.0)), float("-inf"))


@triton.jit
def _weighted(out_ptr, lse_ptr, part, rmask, dims, safe_total, D: tl.constexpr):
    """One split's output (R, D) weighted by its share of the rows' attention, exp(lse_split - lse)."""
    weight = tl.exp(tl.load(lse_ptr + part, mask=rmask, other=float("-inf")) - safe_total)
    return tl.load(out_ptr + part[:, None] * D + dims[None, :], mask=rmask[:, None], other=0.0) * weight[:, None]


def step_table(inv_freq: torch.Tensor, omega: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of t·f for t < Ω, (Ω, D/2) float32: the part of a window's angles it shares with every window."""
    angle = torch.arange(omega, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return angle.cos().contiguous(), angle.sin().contiguous()


def tile_windows(head_dim: int, omega: int) -> int:
    """Windows per tile: 32 keys at head_dim 128, 64 below (sm_90: ~160 registers a thread and no stack either way;
    64 keys at 128 take all 255 registers, bench/kernel_resources.py)."""
    return max(1, (32 if head_dim >= 128 else 64) // omega)


def default_splits(capacity: int, rows: int, heads: int, block_windows: int, device: torch.device) -> int:
    """Enough programs to fill the device (the splits of a (row, head) run side by side), each with a few tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    wanted = max(1, math.ceil(2 * sms / max(1, rows * heads)))
    return max(1, min(wanted, math.ceil(capacity / (2 * block_windows))))


def lowbit_attention(query: torch.Tensor, ledger: PackedWindows, count: torch.Tensor | None, sinks: int,
                     inv_freq: torch.Tensor, rope_scale: float, sm_scale: float, splits: int | None = None,
                     block_windows: int | None = None, step: tuple[torch.Tensor, torch.Tensor] | None = None):
    """query (B, Hkv, R, D): the R = G·L rows of each KV group, post-RoPE; ``ledger`` with room for ``cap``
    windows per row, the first ``count[b]`` of row b live (count (B,) int32 on the device; None: all ``cap``).
    -> (parts_out (B, Hkv, S, R, D), parts_lse (B, Hkv, S, R), win_lse (B, Hkv, cap, R)), float32: S splits of the
    windows, each normalised over its keys; ``merge`` joins them with the full-precision part."""
    b, hkv, r, d = query.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton path (got {d})")
    cap = ledger.k_scale.shape[2]
    omega, bits = ledger.omega, ledger.bits
    wb = block_windows or tile_windows(d, omega)
    splits = splits or default_splits(cap, b, hkv, wb, query.device)
    per_split = max(1, math.ceil(cap / splits))
    cos_t, sin_t = step if step is not None else step_table(inv_freq, omega)
    parts_out = torch.empty(b, hkv, splits, r, d, device=query.device, dtype=torch.float32)
    parts_lse = torch.empty(b, hkv, splits, r, device=query.device, dtype=torch.float32)
    win_lse = torch.empty(b, hkv, cap, r, device=query.device, dtype=torch.float32)  # every slot written by the kernel
    _split_kernel[(b * hkv, splits)](
        query.contiguous(), ledger.k_codes, ledger.k_scale, ledger.k_zero, ledger.v_codes, ledger.v_scale,
        ledger.v_zero, ledger.ids, count, inv_freq.float().contiguous(), cos_t, sin_t, parts_out, parts_lse,
        win_lse, float(rope_scale), float(sm_scale * LOG2E), cap, per_split, SPLITS=splits, HKV=hkv, R=r,
        BLOCK_R=max(16, triton.next_power_of_2(r)), SINKS=sinks, OMEGA=omega, BITS=bits, D=d, WB=wb,
        FAST_TRIG=query.device.type == "cuda")
    return parts_out, parts_lse, win_lse


def merge(parts_out, parts_lse, fp_out, fp_lse, win_lse, ids: torch.Tensor, count: torch.Tensor | None,
          out_dtype: torch.dtype = torch.float32):
    """The low-bit splits (``count`` as ``lowbit_attention``'s) and the full-precision ones (fp_out (B, Hkv, S', R,
    D), fp_lse (B, Hkv, S', R): one split or several, as ``fp_attention.buffer_attention`` gives them) merged by
    log-sum-exp -> (out (B, Hkv, R, D) in
    ``out_dtype`` (the model's: no conversion after), lse (B, Hkv, R), window mass (B, Hkv, cap): the step's attention
    on each live window, summed over the group's rows), float32."""
    b, hkv, splits, r, d = parts_out.shape
    cap = win_lse.shape[2]
    out = torch.empty(b, hkv, r, d, device=parts_out.device, dtype=out_dtype)
    lse = torch.empty(b, hkv, r, device=parts_out.device, dtype=torch.float32)
    mass = torch.empty(b, hkv, cap, device=parts_out.device, dtype=torch.float32)  # every slot written by the kernel
    _merge_kernel[(b * hkv,)](parts_out, parts_lse, fp_out.float().contiguous(), fp_lse.float().contiguous(),
                              win_lse, ids, count, out, lse, mass, cap, SPLITS=splits, FP_SPLITS=fp_out.shape[2],
                              HKV=hkv, R=r, BLOCK_R=max(16, triton.next_power_of_2(r)), D=d, BLOCK_W=64)
    return out, lse, mass


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float):
    angle = positions.float().unsqueeze(-1) * inv_freq.float()
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos() * rope_scale, angle.sin() * rope_scale


def dequantized_keys_reference(ledger: PackedWindows, sinks: int, inv_freq: torch.Tensor, rope_scale: float,
                               dtype: torch.dtype = torch.float32):
    """Dequantize + re-rotate in PyTorch, computed in ``dtype``: (keys (B, Hkv, T, D), values)."""
    keys, values = ledger.dequantize(dtype)
    cos, sin = rope_tables(window_positions(ledger.ids, sinks, ledger.omega), inv_freq, rope_scale)
    keys = keys.to(dtype)
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos[:, None].to(dtype) + rotated * sin[:, None].to(dtype), values.to(dtype)


def lowbit_reference(query, ledger, sinks, inv_freq, rope_scale, sm_scale, dtype=torch.float32):
    """Attention of query (B, Hkv, R, D) over the whole dequantized ledger, all math in ``dtype`` -> (out (B, Hkv, R,
    D), lse (B, Hkv, R), per-window lse (B, Hkv, n, R)), float32."""
    keys, values = dequantized_keys_reference(ledger, sinks, inv_freq, rope_scale, dtype)
    scores = query.to(dtype) @ keys.transpose(2, 3) * sm_scale  # (B, Hkv, R, T)
    b, hkv, r, t = scores.shape
    per_window = scores.float().reshape(b, hkv, r, t // ledger.omega, ledger.omega).logsumexp(-1)
    return ((scores.softmax(-1) @ values).float(), scores.float().logsumexp(-1),
            per_window.transpose(2, 3).contiguous())
