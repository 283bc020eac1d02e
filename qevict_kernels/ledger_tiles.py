"""Triton helpers that read one tile of the write-once ledger: packed codes -> dequantized, re-rotated keys and
dequantized values, in registers. Layout (see qevict_core.engine.ledger.WindowLedger), per (batch, kv head), contiguous:
codes (T, D / C) uint8 with C = 8 // BITS codes per byte (code c of a row in byte c % (D / C) at bit BITS * (c // (D / C)));
key scale/zero
(n_windows, D); value scale/zero (T,); window ids (n_windows,) int32; token t belongs to window t // OMEGA at
position SINKS + id * OMEGA + t % OMEGA."""

import triton
import triton.language as tl


@triton.jit
def load_codes(codes_ptr, tok, dims, tmask, BITS: tl.constexpr, D: tl.constexpr):
    row: tl.constexpr = D * BITS // 8  # bytes per row; code c in byte c % row, bit plane c // row
    packed = tl.load(codes_ptr + tok[:, None] * row + (dims % row)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    return ((packed >> ((dims // row) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def load_keys(k_codes_ptr, k_scale_ptr, k_zero_ptr, ids_ptr, inv_freq_ptr, rope_scale, tok, tmask,
              SINKS: tl.constexpr, OMEGA: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """-> (keys (BLOCK_N, D) post-RoPE float32, positions (BLOCK_N,))."""
    dims = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (dims + half) % D
    win = tok // OMEGA
    pos = SINKS + tl.load(ids_ptr + win, mask=tmask, other=0) * OMEGA + tok % OMEGA
    scale = tl.load(k_scale_ptr + win[:, None] * D + dims[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    zero = tl.load(k_zero_ptr + win[:, None] * D + dims[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    p_scale = tl.load(k_scale_ptr + win[:, None] * D + partner[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    p_zero = tl.load(k_zero_ptr + win[:, None] * D + partner[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    k = load_codes(k_codes_ptr, tok, dims, tmask, BITS, D) * scale + zero
    k_partner = load_codes(k_codes_ptr, tok, partner, tmask, BITS, D) * p_scale + p_zero
    freq = tl.load(inv_freq_ptr + dims % half)
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    sign = tl.where(dims < half, -1.0, 1.0)
    rotated = k * (tl.cos(angle) * rope_scale) + sign[None, :] * k_partner * (tl.sin(angle) * rope_scale)
    return rotated, pos


@triton.jit
def load_values(v_codes_ptr, v_scale_ptr, v_zero_ptr, tok, tmask, BITS: tl.constexpr, D: tl.constexpr):
    dims = tl.arange(0, D)
    scale = tl.load(v_scale_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
    zero = tl.load(v_zero_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
    return load_codes(v_codes_ptr, tok, dims, tmask, BITS, D) * scale[:, None] + zero[:, None]
